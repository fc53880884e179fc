"""Stage two (in progress): a drafter trained from the cache alone learns the tiny target."""

import json

from extract_helpers import write_rows
from pipeline.config import ExtractConfig
from stages.extract import run_extract
from stages.train import TrainConfig, run_train

DESIGN_KEYS = {"step", "epoch", "loss", "accuracy", "top4_acc", "top8_acc", "avg_streak", "ddtree_streak4",
               "ddtree_streak8", "pos_acc", "lr", "grad_norm", "noise_std", "tok_per_sec", "elapsed_s"}


def test_drafter_learns_from_the_cache(tmp_path, train_rows):
    data = write_rows(tmp_path / "convs.jsonl", train_rows[:400])
    run_extract(ExtractConfig(cache=str(tmp_path / "cache"), data=[str(data)], num_shards=2), None, progress=False)
    result = run_train(TrainConfig(cache=str(tmp_path / "cache"), out=str(tmp_path / "run"), max_steps=80,
                                   log_every=10, lr=3e-3), log=lambda *_: None)
    lines = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert DESIGN_KEYS <= set(lines[0])
    assert len(lines[-1]["pos_acc"]) == 7  # slots 1..B-1 for B = 8
    first, last = lines[0], lines[-1]
    assert last["loss"] < 0.5 * first["loss"], (first["loss"], last["loss"])
    assert last["accuracy"] > 0.35 and last["avg_streak"] > 0.5, last
    exported = tmp_path / "run" / "drafter"
    config = json.loads((exported / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 5] and config["block_size"] == 8
    assert result["steps"] == 80
