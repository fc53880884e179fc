"""The kit that the tests and the benchmarks share, and nothing else imports: running the real CLI
(harness.runs), caches read as they are on disk (harness.caches), a real S3-compatible server on
127.0.0.1 (harness.s3_server), kill -9 trials of extraction (harness.kill_trials), the
distribution test for speculative sampling (harness.sampling_stats) and skip marks for what a
machine may lack (harness.marks). Not installed with the package: tests reach it through pytest's
`pythonpath`, benchmarks by putting the repository root on sys.path."""
