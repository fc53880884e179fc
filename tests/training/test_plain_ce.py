"""The plain cross-entropy `ce` in train_log.jsonl (issue 57, item 4): the mean of -log q(label)
over the supervised slots, unweighted, whatever the objective and the slot weights. Checked
against torch's own cross_entropy on the same logits, labels and mask for every loss path, and
between a decay run and a D-PACE run from the same weights and data; and `gamma` with
`--position-weight dpace` refused when the user gave it, recorded as unused when a preset did."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from harness.runs import cli_here, small_cache
from pipeline.records.train_log import LogLine
from pipeline.report.logs import GROUPS
from pipeline.tracking import scalars
from pipeline.training.loss import PLAIN_CE, supervised_loss
from stages.report.run import run_report
from stages.train.run import resolve_config, run_train

V, H, A, B, K = 40, 12, 5, 6, 4


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(A, B, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H ** 0.5
    labels = torch.randint(V, (A, B), generator=g)
    mask = (torch.rand(A, B, generator=g) > 0.3).float()
    mask[:, 0] = 0                                   # slot 0 is never supervised
    decay = torch.exp(-(torch.arange(B) - 1).clamp_min(0) / 4.0)[None] * mask
    soft_ids = torch.randint(V, (A, B, K), generator=g)
    soft_probs = torch.softmax(torch.randn(A, B, K, generator=g), -1)
    return hidden, weight, labels, mask, decay, soft_ids, soft_probs


@pytest.mark.parametrize("loss, soft, dpace", [
    ("ce", False, False),            # the first recipe's path
    ("kl", True, False),             # the first recipe's soft path: the hard label rides along
    ("ce + 0.5*tv", True, False),    # composite terms
    ("ce", False, True),             # D-PACE weights
])
def test_the_plain_ce_sum_is_torch_cross_entropy_over_the_supervised_slots(loss, soft, dpace):
    from pipeline.config import parse_loss

    hidden, weight, labels, mask, decay, soft_ids, soft_probs = _case()
    sums = {}
    supervised_loss(hidden, weight, labels, mask if dpace else decay, soft_ids=soft_ids if soft else None,
                    soft_probs=soft_probs if soft else None, chunk_rows=7, terms=parse_loss(loss),
                    dpace_alpha=0.5 if dpace else None, term_sums=sums)
    rows = mask.bool()
    want = F.cross_entropy((hidden @ weight.t())[rows].double(), labels[rows], reduction="sum")
    assert float(sums[PLAIN_CE]) == pytest.approx(float(want), rel=1e-5)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, train_rows):
    return small_cache(tmp_path_factory.mktemp("plain_ce"), train_rows[:16], 1)


def _train(cache, out, **overrides):
    cfg, preset_target = resolve_config(None, {"cache": str(cache), "out": str(out), "max_steps": 2, "log_every": 1,
                                               "batch_sequences": 4, "micro_batch_sequences": 4, "num_anchors": 32,
                                               **overrides})
    run_train(cfg, preset_target=preset_target, warn=lambda *_: None)
    return [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]


def test_a_decay_run_and_a_dpace_run_log_the_same_ce_from_the_same_weights(cache, tmp_path):
    """Step 1 sees the same initial drafter and the same blocks in both runs: the losses differ
    (different weights and normalisers), the plain ce must not. With the decay's gamma so large
    that every supervised slot weighs 1, the decay loss is the plain mean by its own definition."""
    decay = _train(cache, tmp_path / "decay")
    dpace = _train(cache, tmp_path / "dpace", position_weight="dpace")
    flat = _train(cache, tmp_path / "flat", gamma=1e12)
    assert decay[0]["ce"] == pytest.approx(dpace[0]["ce"], rel=1e-6) == pytest.approx(flat[0]["ce"], rel=1e-6)
    assert flat[0]["loss"] == pytest.approx(flat[0]["ce"], rel=1e-5)
    assert abs(dpace[0]["loss"] - dpace[0]["ce"]) > 0.5   # D-PACE's loss is on another scale
    assert decay[0]["ce"] != decay[0]["loss"]
    records = {name: json.loads((tmp_path / name / "run.json").read_text()) for name in ("decay", "dpace")}
    assert records["decay"]["slot_weights"] == "decay exp(-(k-1)/4)"            # the tiny preset's gamma
    assert records["dpace"]["slot_weights"] == "dpace (alpha 0.5; gamma 4 unused)"


def test_gamma_the_user_gave_is_refused_with_dpace_in_one_line(cache, tmp_path):
    config = tmp_path / "train.toml"
    config.write_text('[train.objective]\ngamma = 5.0\n')
    result = cli_here("train", "--cache", str(cache), "--out", str(tmp_path / "run"), "--config", str(config),
                      "--position-weight", "dpace")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "gamma: position_weight 'dpace' does not use gamma" in lines[0], result.stderr
    assert str(config) in lines[0] and not (tmp_path / "run").exists()
    # The same file with the decay it configures, and D-PACE without a gamma of the user's: accepted.
    assert resolve_config(config, {"cache": str(cache), "position_weight": "decay"})[0].objective.gamma == 5.0
    cfg, _ = resolve_config(None, {"cache": str(cache), "position_weight": "dpace"})
    assert cfg.objective.gamma == 4.0 and cfg.job.preset == "tiny"   # the preset's, unused: run.json says so


def test_ce_is_written_read_tracked_and_reported(tmp_path):
    line = LogLine(step=3, loss=1.5, ce=2.25, accuracy=0.5)
    assert line.to_json() == {"step": 3, "loss": 1.5, "ce": 2.25, "accuracy": 0.5}
    assert LogLine.from_json(line.to_json(), "x").get("ce") == 2.25
    assert scalars(line.to_json())["train/ce"] == 2.25
    assert GROUPS["loss"] == ["loss", "ce"]    # one plot: both curves of every run
    log = tmp_path / "a" / "train_log.jsonl"
    log.parent.mkdir()
    log.write_text("".join(json.dumps({"step": s, "loss": 1 / s, "ce": 2 / s, "accuracy": 0.5}) + "\n"
                           for s in range(1, 41)))
    old = tmp_path / "b" / "train_log.jsonl"   # a run from before `ce`: counted missing, not zero
    old.parent.mkdir()
    old.write_text("".join(json.dumps({"step": s, "loss": 1 / s, "accuracy": 0.5}) + "\n" for s in range(1, 41)))
    result = run_report([log, old], window_size=5, every=20, epochs=None, steps_per_epoch=None, reference_tau=None,
                        plots=None)
    first, second = result["runs"]
    assert first["checkpoints"][-1]["ce"]["mean"] == pytest.approx(sum(2 / s for s in range(36, 41)) / 5)
    assert first["verdicts"]["ce"]["verdict"] == "improving" and second["missing"]["ce"] == 40
    assert result["comparison"][-1]["ce"]["means"]["b"] == "missing"
    shown = cli_here("report", str(log), str(old), "--window", "5", "--every", "20", "--out", str(tmp_path / "plots"))
    assert shown.returncode == 0, shown.stderr
    assert "ce" in shown.stdout.split() and "ce in 40" in shown.stdout
