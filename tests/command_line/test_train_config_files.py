"""train.toml by component: a table a component ([train.optimizer]...), merged preset < file <
flags key by key; the older flat [train] form still loads, with one line naming each key's new
table; a checkpoint that recorded its config flat still resumes. Expected configs are written out
by hand here, not derived from the loader."""

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from pipeline.config import Data, DrafterShape, Job, Objective, Optimizer, Schedule, TrainConfig, Tracking
from pipeline.errors import PipelineError
from pipeline.training.checkpoint import check_resumable
from pipeline.training.configure import resolve_config

NEW_FORM = """
[train.optimizer]
lr = 2e-3
[train.schedule]
batch_sequences = 4
[train.data]
cache = "hs"
max_length = 300
"""
OLD_FORM = """
[train]
lr = 2e-3
batch_sequences = 4
cache = "hs"
max_length = 300
"""


def resolved(tmp_path: Path, text: str, flags: dict | None = None) -> tuple[TrainConfig, list[str]]:
    (tmp_path / "train.toml").write_text(text)
    notes: list[str] = []
    cfg, _ = resolve_config(tmp_path / "train.toml", {"preset": "tiny", **(flags or {})}, note=notes.append)
    return cfg, notes


def tiny_with(tmp_path: Path) -> TrainConfig:
    """The tiny preset (presets/tiny.toml, read by eye) under NEW_FORM's four settings."""
    return TrainConfig(
        job=Job(preset="tiny"),
        data=Data(cache=str(tmp_path / "hs"), max_length=300, num_anchors=512),
        drafter=DrafterShape(num_hidden_layers=2, block_size=8, target_layer_ids=[1, 3, 5], mask_token="<|MASK|>"),
        objective=Objective(gamma=4.0),
        optimizer=Optimizer(lr=2e-3, warmup_steps=20, betas=[0.9, 0.95]),
        schedule=Schedule(num_epochs=6, batch_sequences=4, micro_batch_sequences=8, log_every=10, checkpoint_every=100),
        tracking=Tracking())


def test_the_tables_override_the_preset_key_by_key(tmp_path):
    cfg, notes = resolved(tmp_path, NEW_FORM)
    assert cfg == tiny_with(tmp_path)
    assert notes == []


def test_an_old_flat_file_loads_the_same_config_and_names_each_new_key(tmp_path):
    cfg, notes = resolved(tmp_path, OLD_FORM)
    assert cfg == tiny_with(tmp_path)
    assert len(notes) == 1 and "\n" not in notes[0]
    for where in ("[train.optimizer] lr", "[train.schedule] batch_sequences", "[train.data] cache",
                  "[train.data] max_length"):
        assert where in notes[0]


def test_flags_override_the_file_within_a_table(tmp_path):
    cfg, _ = resolved(tmp_path, NEW_FORM, {"lr": 5e-4, "grad_clip": 0.5})
    assert cfg.optimizer == Optimizer(lr=5e-4, warmup_steps=20, betas=[0.9, 0.95], grad_clip=0.5)
    assert cfg.schedule.batch_sequences == 4


@pytest.mark.parametrize("text, message", [
    ("[train.optimizer]\nbatch_sequences = 4\n",
     "unknown key(s) batch_sequences in [train.optimizer] (batch_sequences belongs in [train.schedule])"),
    ("[train]\nlr = 1e-3\n[train.optimizer]\nlr = 2e-3\n", "lr given both flat and in [train.optimizer]"),
    ("[train]\nlearning_rate = 0.1\n", "unknown key(s) learning_rate in [train]"),
])
def test_a_misplaced_or_unknown_key_is_refused_naming_the_file_and_table(tmp_path, text, message):
    with pytest.raises(PipelineError) as refused:
        resolved(tmp_path, text)
    assert str(refused.value).startswith(str(tmp_path / "train.toml")) and message in str(refused.value)


def test_the_old_form_note_reaches_the_user_of_pipeline_train(tmp_path):
    (tmp_path / "train.toml").write_text("[train]\nlr = 2e-3\n")
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "train.toml"), "--cache", str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert "read as [train.optimizer] lr" in result.output
    assert "no such cache directory" in result.output


def old_record(cfg: TrainConfig) -> dict:
    """The config as a checkpoint of the flat TrainConfig recorded it: every setting at the top."""
    return {k: v for part in dataclasses.fields(cfg) for k, v in dataclasses.asdict(getattr(cfg, part.name)).items()}


def test_a_checkpoint_that_recorded_its_config_flat_still_resumes(tmp_path):
    cfg, _ = resolved(tmp_path, NEW_FORM)
    now = dataclasses.asdict(cfg)
    assert "lr" not in now and now["optimizer"]["lr"] == 2e-3      # recorded by component now
    check_resumable(tmp_path / "step_1", {"config": old_record(cfg), "cache": {}}, now, {})
    changed = old_record(cfg) | {"lr": 1e-3}
    with pytest.raises(PipelineError, match=r"cannot resume, the run's config changed \(lr: 0.001 -> 0.002\)"):
        check_resumable(tmp_path / "step_1", {"config": changed, "cache": {}}, now, {})
