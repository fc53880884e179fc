"""`verify-cache`: one module per family of checks (selection, structure, chunk, label, sample,
model; tap_alignment, the recompute's judge of where stored taps came from), their common report
(check_report), reads bounded to the sound shards (bounded_reads), and one sample shown decoded
(sample_view). They read the cache through pipeline/cache/ only."""
