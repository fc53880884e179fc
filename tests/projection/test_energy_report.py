"""`pipeline cache-info --energy`: the share of the taps' energy the top R components of a pilot
keep, against numpy's SVD of the same tokens' taps, read sample by sample through the reader's
own decoding (an independent path: per sample, not per token range across samples)."""

import json

import numpy as np
import pytest
import torch

from harness.runs import cli_here
from pipeline.cache.reader import open_cache


def first_tokens_taps(cache, tokens: int) -> np.ndarray:
    reader = open_cache(cache)
    rows = []
    for name in sorted(reader.shards):
        shard = reader.shard(name)
        for sid in sorted(shard.sample_ids, key=lambda s: shard.span(int(s))[0]):
            taps = shard.hidden(int(sid)).float()
            rows.append(taps.reshape(taps.shape[0], -1))
    return torch.cat(rows)[:tokens].double().numpy()


def energy_by_svd(x: np.ndarray, projected_rank: int) -> float:
    s = np.linalg.svd(x, compute_uv=False)
    return float((s[:projected_rank] ** 2).sum() / (s ** 2).sum())


@pytest.mark.parametrize("pilot", [300, 10**9])
def test_energy_kept_is_the_pilots_singular_value_share(twelve_rows_cache, pilot):
    cache = str(twelve_rows_cache["cache"])
    done = cli_here("cache-info", cache, "--energy", "8,32,96", "--energy-tokens", str(pilot), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)["energy"]
    x = first_tokens_taps(cache, pilot)
    assert report["pilot_tokens"] == len(x) and report["width"] == x.shape[1]
    for row in report["rows"]:
        assert row["energy"] == pytest.approx(energy_by_svd(x, row["rank"]), abs=2e-6)
    energies = [row["energy"] for row in report["rows"]]
    assert energies == sorted(energies) and energies[-1] < 1


def test_a_rank_that_saves_nothing_is_one_line(twelve_rows_cache):
    cache = str(twelve_rows_cache["cache"])
    width = json.loads(cli_here("cache-info", cache, "--energy", "1", "--json").stdout)["energy"]["width"]
    refused = cli_here("cache-info", cache, "--energy", f"8,{width}")
    assert refused.returncode != 0
    assert f"--energy {width}: the taps are {width} values a token" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
