"""RUN/train_log.jsonl has one writer (`pipeline train`) and one reader (pipeline/records/
train_log.py) that report, the live verdicts, the trackers and the benchmarks go through: a real
run's lines read back key for key against the raw JSON (read here with json alone), a torn last
line is left out, and a malformed line is a one-line error naming file:line."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import PipelineError
from pipeline.records.train_log import LogLine, last_step, read_train_log, trim_to_step
from pipeline.report.logs import read_run

LOG_FILE = "train_log.jsonl"  # the name the README promises, spelled here independently of RunDir


def raw_lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_real_runs_log_reads_back_key_for_key(trained_run):
    path = trained_run["run"] / LOG_FILE
    raw, lines = raw_lines(path), read_train_log(path)
    assert len(lines) == len(raw) and lines[-1].step == trained_run["steps"]
    for line, expected in zip(lines, raw):
        assert line.to_json() == expected                       # same keys, same order, same values
        assert list(line.to_json()) == list(expected)
        assert all(line.get(key) == value for key, value in expected.items())
    assert read_run(path).last_step == trained_run["steps"]


def test_loss_terms_are_written_and_read_as_loss_term_keys():
    line = LogLine(step=3, loss=1.5, loss_terms={"ce": 1.0, "tv": 0.5})
    assert line.to_json() == {"step": 3, "loss": 1.5, "loss_ce": 1.0, "loss_tv": 0.5}
    back = LogLine.from_json(json.loads(json.dumps(line.to_json())), "here")
    assert back == line and back.get("loss_tv") == 0.5 and back.get("loss_kl") is None and back.get("nope") is None


def test_an_older_or_foreign_log_keeps_what_it_has(tmp_path):
    path = tmp_path / LOG_FILE
    path.write_text('{"step": 1, "loss": 2.0, "made_up": 7}\n\n{"step": 2, "loss": NaN, "accuracy": 0.1}\n')
    first, second = read_train_log(path)
    assert first.to_json() == {"step": 1, "loss": 2.0} and first.accuracy is None
    assert second.step == 2 and second.loss != second.loss  # NaN kept: a finding, not a parse error


def test_a_torn_last_line_is_left_out_and_trimming_keeps_lines_byte_for_byte(tmp_path):
    path = tmp_path / LOG_FILE
    kept = '{"step": 10, "loss": 1.25}\n{"step": 20, "loss": 1.0}\n'
    path.write_text(kept + '{"step": 30, "loss": 0.9}\n{"step": 40, "lo')
    assert [line.step for line in read_train_log(path)] == [10, 20, 30]
    trim_to_step(path, 20)
    assert path.read_text() == kept
    assert read_train_log(tmp_path / "absent.jsonl") == []


def test_the_last_step_is_read_from_the_end_of_the_log(tmp_path):
    """What `report --follow` polls: the step of the last complete line, the torn one skipped,
    also when the tail it reads first holds no complete line."""
    path = tmp_path / LOG_FILE
    path.write_text("".join(f'{{"step": {s}, "loss": {1 / s}}}\n' for s in range(1, 301)) + '{"step": 301, "lo')
    assert last_step(path) == 300 == read_train_log(path)[-1].step
    assert last_step(path, tail_bytes=8) == 300     # the tail is less than a line: it reads further back
    path.write_text('{"step": 5}\n{"step": 6')
    assert last_step(path, tail_bytes=4) == 5
    path.write_text('{"step": 6')
    assert last_step(path) is None and last_step(tmp_path / "absent.jsonl") is None


@pytest.mark.parametrize("content, says", [
    ('{"step": 1}\nnot json\n{"step": 3}\n', ":2: not a JSON object"),
    ('{"step": 1}\n[1, 2]\n', ":2: not a JSON object"),
    ('{"loss": 1.0}\n{"step": 2}\n', ":1: a log entry needs a numeric `step`"),
    ('{"step": true}\n', ":1: a log entry needs a numeric `step`"),
])
def test_a_malformed_line_is_one_line_naming_file_and_line(tmp_path, content, says):
    path = tmp_path / LOG_FILE
    path.write_text(content)
    with pytest.raises(PipelineError) as e:
        read_train_log(path)
    assert str(e.value) == f"{path}{says}"
