"""Stage one's driver: a shard's rows through the target into the cache (shard_run), what an
extraction records about itself (extract_record), who writes a shard (claim), and the inputs read
once for the dry run's bill (estimate). The cache's format and storage are pipeline/cache/."""
