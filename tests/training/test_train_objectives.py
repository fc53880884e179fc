"""`pipeline train --loss ... --position-weight dpace` (issue 42): the objectives train from the
cache, each term is logged on its own and they add up to the loss, D-PACE's normaliser keeps
gradient accumulation exact, and bad objective options are one-line errors."""

from __future__ import annotations

import json

import pytest

from harness.runs import cli_here
from stages.train.run import resolve_config, run_train


def train(cache, out, **overrides):
    cfg, preset_target = resolve_config(None, {"cache": str(cache), "out": str(out), **overrides})
    return run_train(cfg, preset_target=preset_target, warn=lambda *_: None)


def read_log(run):
    return [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]


def test_an_acceptance_objective_trains_and_logs_each_term(trained_run, tmp_path):
    train(trained_run["cache"], tmp_path / "run", max_steps=30, warmup_steps=3, log_every=1,
          loss="ce + 0.5*lk", position_weight="dpace", dpace_alpha=0.5)
    lines = read_log(tmp_path / "run")
    for line in lines:
        assert line["loss"] == pytest.approx(line["loss_ce"] + 0.5 * line["loss_lk"], rel=1e-5)
    assert sum(x["loss"] for x in lines[-5:]) / 5 < 0.7 * lines[0]["loss"]
    assert sum(x["accuracy"] for x in lines[-5:]) / 5 > 0.1
    recorded = json.loads((tmp_path / "run" / "run.json").read_text())
    assert "ce + 0.5*lk" in json.dumps(recorded) and "dpace" in json.dumps(recorded)


@pytest.mark.parametrize("loss", ["tv", "nla"])
def test_dpace_gradient_accumulation_equals_one_forward(trained_run, tmp_path, loss):
    """Four micro-batches of one sequence and one of four: the same losses, metrics and weights
    (D-PACE is per block, its normaliser sum(m) is known before any backward)."""
    runs = {}
    for micro in (1, 4):
        out = tmp_path / f"micro{micro}"
        train(trained_run["cache"], out, max_steps=3, log_every=1, batch_sequences=4, micro_batch_sequences=micro,
              loss=loss, position_weight="dpace")
        runs[micro] = read_log(out)
    for a, b in zip(runs[1], runs[4], strict=True):
        for key in ("loss", f"loss_{loss}", "accuracy", "avg_streak", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a["step"])


@pytest.mark.parametrize("args, message", [
    (["--loss", "xe"], "loss 'xe': each term is NAME or COEF*NAME with NAME one of ce, kl, tv, nla, lk"),
    (["--loss", "ce+ce"], "loss 'ce+ce': ce appears twice"),
    (["--position-weight", "linear"], "position_weight must be 'decay' or 'dpace', got 'linear'"),
    (["--dpace-alpha", "0"], "dpace_alpha must be in (0, 1], got 0.0"),
])
def test_bad_objective_options_are_one_line_errors(trained_run, tmp_path, args, message):
    result = cli_here("train", "--cache", str(trained_run["cache"]), "--out", str(tmp_path / "run"), *args)
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
