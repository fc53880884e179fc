"""`pipeline verify-cache` on a projected cache (extract --project-taps R): a sound one passes with
--recompute (its rows against the projection of a fresh forward's taps), the checks that need a
stored tap say why they are skipped, and planted faults are named: rows a position late, rows of
the taps one layer early or late, NaN in a row, a missing or replaced basis.safetensors."""

import json
import re
import shutil

import numpy as np
import pytest
import torch
import zarr

from harness.caches import resign
from harness.runs import cli_here
from pipeline.cache.encoding import encode_hidden
from pipeline.cache.reader import open_cache
from pipeline.cache.schema import HIDDEN, INPUT_IDS
from pipeline.config import ExtractConfig
from pipeline.projection.basis import TapBasis
from pipeline.projection.basis_file import basis_bytes, cache_basis
from stages.extract.run import run_extract
from stages.verify_cache.options import VerifyOptions
from stages.verify_cache.run import run_verify

R, PILOT = 48, 800


@pytest.fixture(scope="module")
def projected(tmp_path_factory, twelve_rows_cache):
    """The twelve-row data extracted projected, once per hidden format: {format: cache}."""
    root = tmp_path_factory.mktemp("projected-verify")
    caches = {}
    for fmt in ("bf16", "fp8"):
        caches[fmt] = root / fmt
        run_extract(ExtractConfig(cache=str(caches[fmt]), data=[str(twelve_rows_cache["data"])], num_shards=3,
                                  batch_tokens=256, project_taps=R, pilot_tokens=PILOT, hidden_format=fmt),
                    None, progress=False)
    return caches


@pytest.fixture
def damaged(projected, tmp_path):
    """A copy of the bf16 projected cache to plant a fault in."""
    cache = tmp_path / "cache"
    shutil.copytree(projected["bf16"], cache)
    return cache


def checks_of(report) -> dict:
    return {c["check"]: c for c in report["checks"]}


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_a_sound_projected_cache_passes_with_the_tap_checks_skipped(projected, fmt):
    result = cli_here("verify-cache", str(projected[fmt]), "--json", "--recompute", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    checks = checks_of(report)
    assert report["passed"]
    assert {name for name, c in checks.items() if c["status"] != "pass"} == {"tail_recompute", "tap_signature"}
    assert checks["tail_recompute"]["status"] == "skipped"
    assert "projected cache: the deepest tap is not stored" in checks["tail_recompute"]["summary"]
    assert "--recompute N checks the projected rows" in checks["tail_recompute"]["summary"]
    assert checks["tap_signature"]["status"] == "skipped"
    assert f"projected cache: the taps are mixed into {R} components" in checks["tap_signature"]["summary"]
    assert "basis.safetensors" in checks["basis"]["summary"]
    assert checks["finite"]["evidence"]["nan_projected"] == 0
    recompute = checks["recompute"]["evidence"]
    # --recompute 2 over 3 shards: one sample of every shard plus the longest, so 4; each tap best
    # matches hidden_states[tap+1] and the rows fit in place, of the layers and shifts tried.
    taps = json.loads((projected[fmt] / "manifest.json").read_text())["config"]["capture"]["target_layer_ids"]
    assert recompute["best_hidden_state_index"] == {str(t): {str(t + 1): 4} for t in taps}
    assert recompute["best_position_shift"] == {"0": 4}
    assert recompute["noise_rms"] <= {"bf16": 0.05, "fp8": 0.15}[fmt]
    assert recompute["rank"] == R and recompute["basis"] == checks["basis"]["evidence"]["digest"]
    assert recompute["argmax_agreement"] > 0.99


def test_the_default_run_passes_without_loading_the_target_for_the_tail(projected):
    report = run_verify(VerifyOptions(cache=projected["bf16"]))
    assert report["passed"], report
    assert checks_of(report)["tail_recompute"]["status"] == "skipped" and report["compute"] is None


def rewrite_hidden(cache, shard: str, rows) -> None:
    """Replace one shard's stored rows by `rows(sample_id, z [T, 1, R] float32, input ids)` per
    sample (encoded as extract encodes them), and re-sign the shard: an extractor with that bug."""
    reader = open_cache(cache)
    s = reader.shard(shard)
    z = torch.cat([rows(int(sid), s.hidden(int(sid)).float(), s.read(INPUT_IDS, int(sid))) for sid in s.sample_ids])
    group = zarr.open_group(str(cache / shard), mode="r+")
    for name, values in encode_hidden(reader.hidden_format, z).items():
        group[name][:] = values
    resign(cache, shard)


def test_rows_a_position_late_are_named_with_the_shift(damaged):
    # each sample's row t holds the row of t-1 (rolled within the sample)
    rewrite_hidden(damaged, "shard-00001", lambda sid, z, ids: torch.roll(z, 1, dims=0))
    report = run_verify(VerifyOptions(cache=damaged, recompute=2))
    assert not report["passed"]
    check = checks_of(report)["recompute"]
    assert check["status"] == "fail" and "projected rows shifted by +1 position" in check["summary"], check
    assert check["evidence"]["best_position_shift"]["1"] >= 1


def rows_of_layers(target, basis, index):
    """A `rewrite_hidden` function: each sample's rows projected from hidden_states[index[k]] in tap
    k's place (an extractor that took the wrong layers or order)."""
    def rows(sid, z, ids):
        with torch.no_grad():
            states = target(input_ids=torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
        return basis.project_taps(torch.stack([states[j][0] for j in index], dim=1))
    return rows


# The tiny target's taps are 1, 3, 5 (hidden_states[2], [4], [6] of 0..8).
@pytest.mark.parametrize("index, named", [
    ([1, 3, 5], ["tap 1 -> hidden_states[1] (tap+1-1)", "tap 3 -> hidden_states[3] (tap+1-1)",
                 "tap 5 -> hidden_states[5] (tap+1-1)"]),
    ([3, 5, 7], ["tap 1 -> hidden_states[3] (tap+1+1)", "tap 3 -> hidden_states[5] (tap+1+1)",
                 "tap 5 -> hidden_states[7] (tap+1+1)"]),
    ([2, 5, 6], ["tap 3 -> hidden_states[5] (tap+1+1)"]),
    ([2, 6, 4], ["tap 3 -> hidden_states[6] (tap+1+2, tap 5's)", "tap 5 -> hidden_states[4] (tap+1-2, tap 3's)"]),
], ids=["all-early", "all-late", "one-late", "two-swapped"])
def test_rows_of_other_layers_are_named_tap_by_tap(damaged, target, index, named):
    """Issue 77.2: the search is per tap, so one tap a layer off and two taps swapped are named
    (before, every tap moved together and only a whole-offset fault could be named)."""
    reader = open_cache(damaged)
    assert reader.manifest.identity.capture.target_layer_ids == [1, 3, 5]
    for shard in ("shard-00000", "shard-00001", "shard-00002"):
        rewrite_hidden(damaged, shard, rows_of_layers(target, cache_basis(reader), index))
    report = run_verify(VerifyOptions(cache=damaged, recompute=2))
    check = checks_of(report)["recompute"]
    assert check["status"] == "fail", check
    assert check["summary"].startswith("projected rows match other layers than the taps': ")
    found = re.findall(r"tap \d+ -> hidden_states\[\d+\] \([^)]*\) in \d+ of \d+", check["summary"])
    assert found == [f"{x} in 4 of 4" for x in named], check["summary"]
    wrong = {str(t): {str(j): 4} for t, j in zip([1, 3, 5], index) if j != t + 1}
    assert {t: b for t, b in check["evidence"]["best_hidden_state_index"].items() if b != {str(int(t) + 1): 4}} == wrong


def test_rows_projected_with_another_pilots_basis_fail_the_tolerance(damaged, target):
    """Rows projected with a basis fitted on another pilot, under the stored basis's name: no layer
    or shift explains them, and the rounding-scaled error is far above the tolerance."""
    from pipeline.projection.basis import SecondMoment, fit_basis

    reader = open_cache(damaged)
    stored_basis = cache_basis(reader)
    moment = SecondMoment(stored_basis.width)
    with torch.no_grad():
        for k in range(4):  # another pilot: random token ids, not the conversations the basis saw
            ids = torch.randint(0, 250, (1, 300), generator=torch.Generator().manual_seed(k))
            states = target(input_ids=ids, output_hidden_states=True).hidden_states
            moment.add(torch.cat([states[t + 1][0] for t in (1, 3, 5)], dim=-1))
    other = fit_basis(moment, stored_basis.projected_rank)
    for shard in ("shard-00000", "shard-00001", "shard-00002"):
        rewrite_hidden(damaged, shard, rows_of_layers(target, other, [2, 4, 6]))
    check = checks_of(run_verify(VerifyOptions(cache=damaged, recompute=2)))["recompute"]
    assert check["status"] == "fail" and check["evidence"]["max_rel"] > 1.0, check
    assert "rounding-scaled error" in check["summary"] and "(tolerance 0.05)" in check["summary"]


def test_nan_in_a_projected_row_is_counted_for_the_row(damaged):
    hidden = zarr.open_array(str(damaged / "shard-00002" / HIDDEN), mode="r+")
    values = hidden[:]
    values[::5, 0, :3] = 0x7FC0  # bfloat16 NaN bit pattern
    hidden[:] = values
    resign(damaged, "shard-00002")
    report = run_verify(VerifyOptions(cache=damaged))
    check = checks_of(report)["finite"]
    assert check["status"] == "fail" and "NaN/Inf in the projected row" in check["summary"], check
    assert check["evidence"]["nan_projected"] > 0 and "shard-00002" in check["summary"]


def another_basis(cache) -> bytes:
    """A basis.safetensors of another digest: the stored one with its first component negated
    (still orthonormal, so only the digest tells it apart)."""
    basis = cache_basis(open_cache(cache))
    components = basis.components.clone()
    components[0] = -components[0]
    return basis_bytes(TapBasis(components=components, scales=basis.scales, energy=basis.energy,
                                pilot_tokens=basis.pilot_tokens), "replaced")


@pytest.mark.parametrize("plant, message", [
    (lambda cache: (cache / "basis.safetensors").write_bytes(another_basis(cache)), "is not the manifest's"),
    (lambda cache: (cache / "basis.safetensors").unlink(), "missing"),
    (lambda cache: (cache / "basis.safetensors").write_bytes(b"not a basis"), "not a tap basis"),
], ids=["replaced", "missing", "torn"])
def test_a_bad_basis_file_fails_in_one_line_naming_it(damaged, plant, message):
    plant(damaged)
    report = run_verify(VerifyOptions(cache=damaged, recompute=2))
    assert not report["passed"]
    checks = checks_of(report)
    basis = checks["basis"]
    assert basis["status"] == "fail" and "basis.safetensors" in basis["summary"] and message in basis["summary"], basis
    assert "\n" not in basis["summary"]
    # nothing to project the fresh taps with: the recompute says why it did not run
    assert checks["recompute"]["status"] == "skipped" and "basis.safetensors" in checks["recompute"]["summary"]
