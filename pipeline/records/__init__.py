"""The files a run leaves behind, as typed records: each has one writer and one reader here, and
every command that reads one (train, eval, report) goes through them. run_dir.py: where each file
and folder of a run directory RUN is (RunDir, the layout in one place); run.py: RUN/run.json;
train_log.py: RUN/train_log.jsonl; eval_result.py: `pipeline eval --json` (where each decoding
variant's figures sit and what it is called); verify_result.py: `pipeline verify-cache --json`;
verdicts.py: RUN/verdicts.jsonl. typed.py: the one mechanism for typed JSON records (dataclasses
read field by field and written back), shared with the cache manifest."""
