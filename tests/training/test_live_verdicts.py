"""Live verdicts (pipeline/report/live.py): on logs built here with a known fault at a known step
(the oracle is the construction), and on real training runs with a fault planted in the trainer
(PIPELINE_PLANT): each fires its verdict during the run, once; a clean run fires none (the clean
run is test_tracking's, which also checks that verdicts reach the trackers' files)."""

import json
import math
import random

import pytest
from harness.runs import small_cache
from harness.prerequisites import importable

from pipeline.faults import LR_BLOWUP_STEP, PLANT_ENV
from pipeline.records.train_log import LogLine
from pipeline.report.live import LiveVerdicts
from stages.train.run import resolve_config, run_train

VOCAB = 512


def synthetic(steps: int, *, loss=None, accuracy=None, grad_norm=None, seed=0) -> list[dict]:
    """A log line per step: a healthy run (loss falling from 6 towards 1, accuracy rising), each
    series replaceable by a function of the step; small seeded noise on everything."""
    rng = random.Random(seed)
    out = []
    for s in range(1, steps + 1):
        healthy_loss = 1 + 5 * math.exp(-s / 40)
        healthy_acc = 0.8 * (1 - math.exp(-s / 40))
        out.append({"step": s, "loss": (loss(s) if loss else healthy_loss) + rng.gauss(0, 0.02),
                    "accuracy": (accuracy(s) if accuracy else healthy_acc) + rng.gauss(0, 0.005),
                    "avg_streak": 2 * healthy_acc + rng.gauss(0, 0.01), "lr": 1e-3,
                    "grad_norm": (grad_norm(s) if grad_norm else 1.0) + abs(rng.gauss(0, 0.05)),
                    "pos_acc": [healthy_acc] * 7})
    return out


def watch(log: list[dict], **kwargs) -> list:
    live = LiveVerdicts(total_steps=kwargs.pop("total", 400), warmup_steps=kwargs.pop("warmup", 10), peak_lr=1e-3,
                        vocab_size=VOCAB, **kwargs)
    fired = []
    for record in log:
        fired += live.observe(LogLine.from_json(record, "synthetic"))
    return fired


def test_a_healthy_log_fires_nothing():
    assert watch(synthetic(400)) == []


def test_a_non_finite_loss_fires_at_its_step_once():
    log = synthetic(100, loss=lambda s: math.nan if s >= 60 else 2.0)
    fired = [v for v in watch(log) if v.cause == "non_finite"]
    assert len(fired) == 1 and fired[0].step == 60 and "loss" in fired[0].message


def test_a_loss_that_never_falls_fires_loss_flat():
    fired = watch(synthetic(200, loss=lambda s: 3.0, accuracy=lambda s: 0.3))
    assert [v.cause for v in fired] == ["loss_flat"]
    assert 10 < fired[0].step <= 100  # after warmup, in the first half


def test_a_loss_at_chance_with_no_accuracy_fires_labels_not_learnable():
    chance = math.log(VOCAB)
    fired = watch(synthetic(200, loss=lambda s: chance + 2 * math.exp(-s / 5), accuracy=lambda s: 0.002))
    causes = [v.cause for v in fired]
    assert "labels_not_learnable" in causes
    first = next(v for v in fired if v.cause == "labels_not_learnable")
    assert 10 < first.step <= 40 and 0.9 * chance <= first.figure <= chance + 0.5  # after warmup


def test_a_grad_norm_spike_fires_at_its_step_and_a_two_fold_wobble_does_not():
    spike = watch(synthetic(200, grad_norm=lambda s: 20.0 if s == 120 else 1.0))
    assert [(v.cause, v.step) for v in spike] == [("grad_norm_spike", 120)]
    assert watch(synthetic(200, grad_norm=lambda s: 2.0 if s == 120 else 1.0)) == []


def test_a_sudden_jump_in_loss_is_one_cliff_naming_the_metric():
    fired = watch(synthetic(200, loss=lambda s: 6.0 if s >= 150 else 1 + 5 * math.exp(-s / 40)))
    # The cliff first, once; later the loss is back at its starting level, so loss_flat may follow.
    assert [v.cause for v in fired][:1] == ["quality_cliff"] and [v.cause for v in fired].count("quality_cliff") == 1
    assert set(v.cause for v in fired) <= {"quality_cliff", "loss_flat"}
    assert fired[0].step == 150 and "loss jumped" in fired[0].message


def test_accuracy_wobbling_near_zero_is_no_cliff():
    """At chance, accuracy halving from 0.003 to 0.0015 is many spreads and far more than 5% of
    itself, yet a tenth of an accuracy point: no cliff (the same fall from 0.3 to 0.15 is one)."""
    def at_chance(level):
        return lambda s: level if s < 150 else level / 2
    near_zero = watch(synthetic(200, loss=lambda s: 3.0 - s / 1000, accuracy=at_chance(0.003)))
    assert "quality_cliff" not in [v.cause for v in near_zero]
    real = watch(synthetic(200, loss=lambda s: 3.0 - s / 1000, accuracy=at_chance(0.3)))
    assert [(v.cause, v.step) for v in real if v.cause == "quality_cliff"] == [("quality_cliff", 150)]


# ----------------------------------------------------------------------------- real runs, planted faults


@pytest.fixture(scope="module")
def cache(tmp_path_factory, train_rows):
    # Rows of one kind (thinking, no tools): batches of mixed kinds swing accuracy by half between
    # steps on their own (0.14 -> 0.06 at step 18 of a clean run), which hides where a fault began.
    alike = [r for r in train_rows if not r.get("tools") and r["chat_template_kwargs"]["enable_thinking"]]
    return small_cache(tmp_path_factory.mktemp("verdicts"), alike[:160], 2)


def planted_run(cache, out, plant, monkeypatch, **overrides) -> tuple[dict, list[str]]:
    monkeypatch.setenv(PLANT_ENV, plant)
    warnings = []
    cfg, preset = resolve_config(None, {"cache": str(cache), "out": str(out), "max_steps": 40, "log_every": 2,
                                        **overrides})
    summary = run_train(cfg, preset_target=preset, warn=warnings.append)
    return summary, warnings


def test_random_labels_fire_labels_not_learnable_live(cache, tmp_path, monkeypatch):
    importable("tensorboard", "the test extra installs the trackers")
    summary, warnings = planted_run(cache, tmp_path / "run", "random_labels", monkeypatch, report_to="tensorboard,mlflow")
    lines = [w for w in warnings if "labels_not_learnable" in w]
    assert len(lines) == 1 and summary["verdicts"][0] == lines[0], warnings
    recorded = [json.loads(x) for x in (tmp_path / "run" / "verdicts.jsonl").read_text().splitlines()]
    # Its own verdict first; the loss also barely falls (6.5 -> 6.3), so loss_flat may join it.
    assert recorded[0]["cause"] == "labels_not_learnable", recorded
    assert {v["cause"] for v in recorded} <= {"labels_not_learnable", "loss_flat"} and len(recorded) <= 2
    # Fired during the run: at the first check past warmup (20 steps), long before the end.
    assert 20 < recorded[0]["step"] <= 30, recorded
    # The verdict reached the trackers, read back with their own readers.
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    text = events.Tensors("verdicts/labels_not_learnable/text_summary")[0]
    assert text.step == recorded[0]["step"] and "uniform guess" in text.tensor_proto.string_val[0].decode()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    run_id = json.loads((tmp_path / "run" / "trackers.json").read_text())["mlflow"]
    tag = client.get_run(run_id).data.tags["verdict.labels_not_learnable"]
    assert tag.startswith(f"step {recorded[0]['step']}: loss ")


def test_a_learning_rate_blowup_fires_a_cliff_live(cache, tmp_path, monkeypatch):
    summary, warnings = planted_run(cache, tmp_path / "run", "lr_blowup", monkeypatch)
    recorded = [json.loads(x) for x in (tmp_path / "run" / "verdicts.jsonl").read_text().splitlines()]
    cliffs = [v for v in recorded if v["cause"] == "quality_cliff"]
    assert len(cliffs) == 1 and LR_BLOWUP_STEP <= cliffs[0]["step"] <= LR_BLOWUP_STEP + 12, recorded
    assert "loss jumped" in cliffs[0]["message"]
    assert [v["cause"] for v in recorded] == [line.split(": ")[1] for line in summary["verdicts"]]

