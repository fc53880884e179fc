"""The run directory's names (pipeline/records/run_dir.py) are the ones the README promises a user
(Training: Output, One training per run directory; Trackers; Watching a run): a renamed file in the
layout type, or in the README, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.records.run_dir import RunDir

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
RUN = RunDir(Path("RUN"))
NAMED = {"drafter": RUN.drafter, "run_record": RUN.run_record,
         "train_log": RUN.train_log, "verdicts": RUN.verdicts, "owner": RUN.owner, "owner_lock": RUN.owner_lock,
         "tracker_ids": RUN.tracker_ids, "tensorboard": RUN.tensorboard, "mlflow_store": RUN.mlflow_store,
         "mlflow_artifacts": RUN.mlflow_artifacts, "report": RUN.report,
         # the README writes a checkpoint (and so the checkpoints folder) as checkpoints/step-N/
         "checkpoint": Path(re.sub(r"\d+", "N", RUN.checkpoint(500).as_posix()))}


def promised(relative: str) -> bool:
    """The README quotes it as code: alone, under a run directory's name (RUN/, R/, runs/a/), or as a folder."""
    return re.search(r"`(?:[\w.-]+/)*" + re.escape(relative) + r"/?`", README) is not None


@pytest.mark.parametrize("name", sorted(NAMED))
def test_each_name_is_the_one_the_readme_promises(name):
    relative = NAMED[name].relative_to(RUN.path).as_posix()
    assert promised(relative), f"RunDir.{name} is {relative!r}, which the README does not name"


def test_a_checkpoint_is_found_by_its_step_and_a_temporary_is_not():
    assert RunDir.checkpoint_step(RUN.checkpoint(500)) == 500
    assert RunDir.checkpoint_step(RUN.checkpoint_temporary(500, 1234)) is None
    assert RUN.checkpoint(500).parent == RUN.checkpoint_temporary(500, 1234).parent == RUN.checkpoints


def test_the_run_directory_of_its_files():
    assert RunDir.holding(RUN.train_log) == RUN and RunDir.holding(RUN.drafter) == RUN
    assert RunDir("RUN") == RUN
