"""`pipeline report` on synthetic logs with known shapes: each is detected, or not, as it should be."""

import json
import math
import random
from pathlib import Path

import pytest

from harness.runs import cli, cli_here
from pipeline.errors import PipelineError
from pipeline.records.run_dir import RunDir
from stages.report.run import run_report

STEPS = range(10, 2001, 10)   # 200 entries, 100 steps per epoch


def write_log(path, accuracy, *, seed=0, noise=0.01, drop=(), extra=None):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for step in STEPS:
            acc = accuracy(step) + rng.gauss(0, noise)
            record = {"step": step, "epoch": step // 100, "steps_per_epoch": 100, "loss": 3 * (1 - acc) + 0.1,
                      "accuracy": acc, "top4_acc": min(1.0, acc + 0.1), "top8_acc": min(1.0, acc + 0.15),
                      "avg_streak": 7 * acc, "ddtree_streak4": 7 * acc + 0.5, "ddtree_streak8": 7 * acc + 0.8,
                      "lr": 1e-3, "grad_norm": 1.0 + rng.gauss(0, 0.05)}
            for key in drop:
                if step % 20 == 0:
                    record.pop(key, None)
            record.update((extra or {}).get(step, {}))
            f.write(json.dumps(record) + "\n")
    return path


def report(*paths, **kw):
    options = {"window_size": 20, "every": 500, "epochs": None, "steps_per_epoch": None, "reference_tau": None,
               "plots": None}
    return run_report(list(paths), **{**options, **kw})


def healthy(step):
    return 0.9 - 0.8 * math.exp(-step / 900)


def test_a_healthy_run_is_improving_without_cliffs(tmp_path):
    run = report(write_log(tmp_path / "healthy.jsonl", healthy))["runs"][0]
    assert run["verdicts"]["accuracy"]["verdict"] == "improving"
    assert run["verdicts"]["loss"]["verdict"] == "improving"
    assert run["cliffs"] == [] and run["grad_norm_anomalies"] == []
    assert run["half_epochs"]["accuracy"][-1]["verdict"] in ("improving", "plateau")
    # Extrapolated to the end of the logged run: near the curve's value there, not beyond 1.
    assert abs(run["extrapolated"]["accuracy"] - healthy(2000)) < 0.03


def test_a_plateau_is_a_plateau(tmp_path):
    run = report(write_log(tmp_path / "flat.jsonl", lambda s: 0.8 if s > 400 else 0.2 + 0.6 * s / 400))["runs"][0]
    assert run["verdicts"]["accuracy"]["verdict"] == "plateau"
    assert abs(run["verdicts"]["accuracy"]["z"]) < 2
    late = [h for h in run["half_epochs"]["accuracy"] if h["from_epoch"] >= 5]
    assert all(h["verdict"] == "plateau" for h in late if "verdict" in h)


def test_a_slow_regression_is_a_regression(tmp_path):
    run = report(write_log(tmp_path / "worse.jsonl", lambda s: min(0.8, s / 1000) - max(0, s - 1000) * 2e-4))["runs"][0]
    assert run["verdicts"]["accuracy"]["verdict"] == "regressing"
    assert run["verdicts"]["loss"]["verdict"] == "regressing"
    assert run["cliffs"] == []  # gradual, not a cliff


def test_a_cliff_is_found_where_it_happens(tmp_path):
    run = report(write_log(tmp_path / "cliff.jsonl", lambda s: healthy(s) if s < 1200 else 0.3))["runs"][0]
    found = [c for c in run["cliffs"] if c["metric"] == "accuracy"]
    assert len(found) == 1 and 1200 <= found[0]["step"] <= 1230, found
    assert found[0]["before"] > 0.6 and found[0]["after"] < 0.4   # healthy(1200) = 0.69


def test_grad_norm_spikes_and_nan_are_anomalies(tmp_path):
    log = write_log(tmp_path / "spiky.jsonl", healthy, extra={700: {"grad_norm": 50.0}, 1500: {"grad_norm": float("nan")}})
    steps = [a["step"] for a in report(log)["runs"][0]["grad_norm_anomalies"]]
    assert steps == [700, 1500]


def test_missing_keys_are_reported_and_never_averaged_as_zero(tmp_path):
    log = write_log(tmp_path / "gaps.jsonl", lambda s: 0.8, noise=0.0, drop=("avg_streak", "ddtree_streak8"))
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    for x in lines:
        x.pop("top8_acc")
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = report(log)["runs"][0]
    assert run["missing"]["avg_streak"] == 100 and run["missing"]["top8_acc"] == 200
    assert run["verdicts"]["top8_acc"] == {"verdict": "missing"}
    last = run["checkpoints"][-1]
    assert last["top8_acc"] == "missing"
    assert last["avg_streak"]["mean"] == pytest.approx(7 * 0.8) and last["avg_streak"]["n"] == 20


def test_two_runs_side_by_side(tmp_path):
    a = write_log(tmp_path / "a.jsonl", healthy, seed=1)
    b = write_log(tmp_path / "b.jsonl", lambda s: healthy(s) + 0.05, seed=2)
    result = report(a, b, reference_tau=6.0)
    last = result["comparison"][-1]
    assert last["accuracy"]["leader"] == "b" and last["accuracy"]["significant"]
    assert last["loss"]["leader"] == "b"  # lower loss leads
    assert last["accuracy"]["margin"] == pytest.approx(0.05, abs=0.02)
    ref = result["runs"][1]["reference"]
    assert ref["extrapolated_tau"] == pytest.approx(7 * (healthy(2000) + 0.05) + 1, abs=0.3)


def test_cli_writes_plots_and_json(tmp_path):
    a = write_log(tmp_path / "a.jsonl", healthy)
    b = write_log(tmp_path / "b.jsonl", lambda s: healthy(s) + 0.05, seed=3)
    result = cli("report", str(a), str(b), "--out", str(tmp_path / "plots"), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert len(data["plots"]) == 4
    for path in data["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    human = cli_here("report", str(a), "--out", str(tmp_path / "plots2"))
    assert human.returncode == 0 and "verdict" in human.stdout and "improving" in human.stdout


def test_plots_land_in_the_run_directory_without_out(tmp_path, monkeypatch):
    """Without --out the plots go to RUN/report/ of the first run given, not into the directory
    the command runs from (a checkout's root once collected a dflash-report/ of them)."""
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    other.mkdir()
    write_log(RunDir(run).train_log, healthy)
    write_log(RunDir(other).train_log, lambda s: healthy(s) + 0.05, seed=3)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = cli_here("report", str(run), str(other), "--json")
    assert result.returncode == 0, result.stderr
    plots = [Path(p) for p in json.loads(result.stdout)["plots"]]
    assert len(plots) == 4 and all(p.parent == RunDir(run).report for p in plots) and all(p.is_file() for p in plots)
    assert list(elsewhere.iterdir()) == [] and not (other / "report").exists()


def test_a_malformed_log_line_is_one_clear_error(tmp_path):
    log = write_log(tmp_path / "bad.jsonl", healthy)
    lines = log.read_text().splitlines()
    lines[5] = "{not json"
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(PipelineError, match=r"bad.jsonl:6: not a JSON object"):
        report(log)
    lines[5] = "{not json"
    torn = tmp_path / "torn.jsonl"
    torn.write_text("\n".join(lines[:5] + lines[6:]) + "\n{\"step\": 20")   # a killed run's last line
    assert report(torn)["runs"][0]["entries"] == 199


def test_follow_redraws_as_a_real_run_logs_and_stops_when_it_ends(tmp_path, sixty_four_rows_cache):
    """`pipeline report RUN --follow` started before a real training run: it waits for the log,
    re-draws as lines arrive (each re-draw one JSON line with a later last step), and exits 0 on
    its own once the log reaches the plan's last step."""
    import subprocess
    import sys
    import time

    from harness.runs import REPO

    run = tmp_path / "run"
    env = {**__import__("os").environ, "NO_COLOR": "1", "COLUMNS": "200"}
    follower = subprocess.Popen([sys.executable, "-m", "cli", "report", str(run), "--follow", "--interval", "0.3",
                                 "--json", "--out", str(tmp_path / "plots")], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1)
    trained = cli_here("train", "--cache", str(sixty_four_rows_cache), "--out", str(run), "--max-steps", "30", "--log-every", "2")
    assert trained.returncode == 0, trained.stderr
    out, err = follower.communicate(timeout=120)
    assert follower.returncode == 0, err
    steps = [json.loads(line)["runs"][0]["last_step"] for line in out.splitlines()]
    assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] == 30, steps
    assert (tmp_path / "plots" / "report-loss.png").is_file()
