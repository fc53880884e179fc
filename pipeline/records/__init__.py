"""The files a run leaves behind, as typed records: each has one writer and one reader here, and
every command that reads one (train, eval, report) goes through them. run.py: RUN/run.json."""
