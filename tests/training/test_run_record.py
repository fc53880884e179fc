"""RUN/run.json has one writer (`pipeline train`) and one reader (pipeline/records/run.py) that
eval and report go through: a real run's file reads back field for field, and a bad file is a
one-line error naming it."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import PipelineError
from pipeline.records.run import read_run_record
from pipeline.report.logs import run_finished
from pipeline.eval.drafter_source import resolve_drafter


def test_a_real_runs_record_reads_back_field_for_field(trained_run):
    raw = json.loads((trained_run["run"] / "run.json").read_text())
    record = read_run_record(trained_run["run"])
    assert {name: getattr(record, name) for name in raw} == raw  # every written key is a field
    assert record.total_steps == trained_run["steps"] == raw["plan"]["total_steps"]
    assert run_finished(trained_run["run"] / "train_log.jsonl")
    _, recorded = resolve_drafter(trained_run["run"])
    assert (recorded.path, recorded.config_sha256) == (raw["target"], raw["target_config_sha256"])


def test_an_older_record_without_the_newer_fields_still_reads(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"target": "/models/t", "config": {}, "plan": {"total_steps": 5},
                                                   "drafter": {}, "some_future_field": 1}))
    record = read_run_record(tmp_path)
    assert (record.target, record.total_steps, record.loss_path, record.resumed_from_step) == ("/models/t", 5, None, 0)


@pytest.mark.parametrize("content, says", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"config": {}, "plan": {}, "drafter": {}}), "no 'target'"),
    (json.dumps({"target": 3, "config": {}, "plan": {}, "drafter": {}}), "'target' must be a path"),
])
def test_a_bad_record_is_one_line_naming_the_file(tmp_path, content, says):
    path = tmp_path / "run.json"
    path.write_text(content)
    with pytest.raises(PipelineError) as e:
        read_run_record(path)
    message = str(e.value)
    assert str(path) in message and says in message and "\n" not in message
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{}")
    with pytest.raises(PipelineError, match="not a training run record"):
        resolve_drafter(tmp_path)
