"""Stage one's driver: a shard's rows through the target into the cache (shard_run), what an
extraction records about itself (extract_record), who writes a shard (claim), the inputs read
once for the dry run's bill (estimate), and a projected cache's basis, fitted on a pilot once
before any shard (pilot_run). The cache's format and storage are pipeline/cache/."""
