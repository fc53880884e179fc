"""`extract --project-taps R` end to end on the embedded target: the stored rows against the full
taps of the same conversations in an unprojected cache (the twelve-row reference), projected by
the stored basis in numpy; the basis against numpy's SVD of the pilot's taps; one basis per cache
(a resume reads it, never refits; other settings and mixed bases are refused in one line); train
on the projected cache, its export folded, eval's teacher-forced walk through the reconstruction."""

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from harness.caches import edit_record, resign
from harness.runs import cli_here
from pipeline.cache.reader import open_cache
from pipeline.config import ExtractConfig
from pipeline.errors import PipelineError
from stages.extract.run import run_extract

R, PILOT = 48, 800


@pytest.fixture(scope="module")
def projected(tmp_path_factory, twelve_rows_cache):
    root = tmp_path_factory.mktemp("projected")
    cfg = ExtractConfig(cache=str(root / "cache"), data=[str(twelve_rows_cache["data"])], num_shards=3,
                        batch_tokens=256, project_taps=R, pilot_tokens=PILOT)
    result = run_extract(cfg, None, progress=False)
    return {"root": root, "cache": root / "cache", "cfg": cfg, "result": result}


def stored_basis(cache):
    tensors = load_file(str(cache / "basis.safetensors"))
    return tensors["components"].double().numpy(), tensors["scales"].double().numpy()


def full_taps_by_sample(cache) -> dict[int, np.ndarray]:
    reader = open_cache(cache)
    out = {}
    for name in reader.shards:
        shard = reader.shard(name)
        for sid in shard.sample_ids:
            taps = shard.hidden(int(sid)).double().numpy()
            out[int(sid)] = taps.reshape(len(taps), -1)
    return out


def test_rows_are_the_full_taps_projected_by_the_stored_basis(projected, twelve_rows_cache):
    p, s = stored_basis(projected["cache"])
    assert p.shape == (R, 3 * 128) and s.shape == (R,)
    np.testing.assert_allclose(p @ p.T, np.eye(R), atol=1e-5)
    full = full_taps_by_sample(twelve_rows_cache["cache"])
    reader = open_cache(projected["cache"])
    seen = 0
    for name in reader.shards:
        shard = reader.shard(name)
        for sid in map(int, shard.sample_ids):
            z = shard.hidden(sid).double().numpy()
            assert z.shape == (len(full[sid]), 1, R)
            expected = (full[sid] @ p.T) / s
            # bf16 on both sides (the reference stores bf16 taps, the projected cache bf16 rows)
            np.testing.assert_allclose(z[:, 0], expected, atol=0.03 * np.abs(expected).max())
            seen += 1
    assert seen == 12


def test_the_basis_is_the_pilots_top_subspace(projected, twelve_rows_cache):
    # The pilot: the first PILOT tokens in sample-id order (row order), each sample's tokens in order.
    full = full_taps_by_sample(twelve_rows_cache["cache"])
    x = np.concatenate([full[sid] for sid in sorted(full)])[:PILOT]
    _, sv, vt = np.linalg.svd(x, full_matrices=False)
    p, s = stored_basis(projected["cache"])
    manifest = json.loads((projected["cache"] / "manifest.json").read_text())
    record = manifest["config"]["capture"]["projection"]
    assert record["rank"] == R and record["pilot_tokens"] == PILOT
    assert record["energy"] == pytest.approx(float((sv[:R] ** 2).sum() / (sv ** 2).sum()), abs=1e-3)
    # the stored basis captures the pilot as the SVD's top R do (bf16 vs float32 taps aside)
    kept = np.linalg.norm(x @ p.T) ** 2 / np.linalg.norm(x) ** 2
    assert kept == pytest.approx(record["energy"], abs=1e-3)
    np.testing.assert_allclose(s, sv[:R] / np.sqrt(PILOT), rtol=0.02)


def test_a_resume_reads_the_basis_and_other_settings_are_refused_in_one_line(projected):
    cache, cfg = projected["cache"], projected["cfg"]
    before = (cache / "basis.safetensors").read_bytes()
    again = run_extract(cfg, None, progress=False)
    assert again["projection"]["basis"] == "read from the cache" and again["shards_already_committed"] == 3
    assert (cache / "basis.safetensors").read_bytes() == before
    for extra in (["--project-taps", "32"], []):
        done = cli_here("extract", "--cache", str(cache), "--data", cfg.data[0], "--num-shards", "3", *extra)
        assert done.returncode != 0
        assert len(done.stderr.strip().splitlines()) == 1 and "projected" in done.stderr, done.stderr
    done = cli_here("extract", "--cache", str(cache), "--data", cfg.data[0], "--num-shards", "3",
                    "--project-taps", str(3 * 128))
    assert done.returncode != 0 and "saves nothing" in done.stderr


def test_a_shard_in_another_basis_is_refused(projected, tmp_path):
    import shutil
    cache = tmp_path / "mixed"
    shutil.copytree(projected["cache"], cache)
    edit_record(cache, "shard-00001", lambda r: r["identity"].update(projection_digest="0" * 64))
    resign(cache, "shard-00001")
    with pytest.raises(PipelineError, match="shard-00001.*basis"):
        open_cache(cache)


def test_train_on_the_projected_cache_exports_an_ordinary_folded_drafter(projected):
    out = projected["root"] / "run"
    done = cli_here("train", "--cache", str(projected["cache"]), "--out", str(out), "--max-steps", "4",
                    "--noise-std", "0.05", "--json")
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert "projected_rank" not in config
    weights = load_file(str(out / "drafter" / "model.safetensors"))
    assert tuple(weights["fc.weight"].shape) == (128, 3 * 128)
    # the fold against the last checkpoint's drafter (fc' on the projection), in numpy
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    trained = load_file(str(checkpoints[-1] / "drafter" / "model.safetensors"))
    assert tuple(trained["fc.weight"].shape) == (128, R)
    p, s = stored_basis(projected["cache"])
    # the default fc' reads each component at its pilot RMS (z * s = P x): the export's fc is W' P
    assert json.loads((checkpoints[-1] / "drafter" / "config.json").read_text())["projected_energy"] is True
    folded = trained["fc.weight"].double().numpy() @ p
    np.testing.assert_allclose(weights["fc.weight"].double().numpy(), folded, rtol=1e-5, atol=1e-6)
    # eval's teacher-forced walk on the projected cache: the folded drafter reads the reconstruction
    done = cli_here("eval", "--drafter", str(out), "--cache", str(projected["cache"]), "--max-new-tokens", "4",
                    "--tree-budget", "", "--limit", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["teacher_forced"]["anchors"] > 0
    # the basis is the run's identity: run.json and the report name it, a resume on another basis is refused
    digest = json.loads((projected["cache"] / "manifest.json").read_text())["config"]["capture"]["projection"]["digest"]
    assert json.loads((out / "run.json").read_text())["tap_projection"]["digest"] == digest
    assert f"fc trained on {R} values a token" in cli_here("report", str(out)).stdout
    other = projected["root"] / "other-basis"
    run_extract(ExtractConfig(**{**projected["cfg"].__dict__, "cache": str(other), "pilot_tokens": 600}), None,
                progress=False)
    done = cli_here("train", "--cache", str(other), "--out", str(out), "--max-steps", "4", "--noise-std", "0.05")
    assert done.returncode != 0 and "cannot resume, the cache differs" in done.stderr
    # the checkpoint's drafter (fc' not folded) cannot run on the live target's full taps
    from pipeline.embedded import TARGET_DIR
    done = cli_here("eval", "--drafter", str(checkpoints[-1] / "drafter"), "--target", str(TARGET_DIR),
                    "--max-new-tokens", "4", "--limit", "1")
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1 and "RUN/drafter" in done.stderr


def test_cache_info_shows_the_projection_and_refuses_energy_of_a_projection(projected):
    done = cli_here("cache-info", str(projected["cache"]), "--json")
    assert json.loads(done.stdout)["identity"]["capture"]["projection"]["rank"] == R
    done = cli_here("cache-info", str(projected["cache"]), "--energy", "8")
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1 and "projected already" in done.stderr


def test_the_dry_run_bills_the_projected_bytes_and_the_pilot(projected):
    cfg = projected["cfg"]
    done = cli_here("extract", "--dry-run", "--cache", str(projected["root"] / "none"), "--data", cfg.data[0],
                    "--num-shards", "3", "--project-taps", str(R), "--pilot-tokens", str(PILOT), "--json")
    bill = json.loads(done.stdout)
    full = json.loads(cli_here("extract", "--dry-run", "--cache", str(projected["root"] / "none"), "--data", cfg.data[0],
                               "--num-shards", "3", "--json").stdout)
    # the hidden array: R bf16 values instead of 3 x 128
    assert full["raw_bytes_per_token"] - bill["raw_bytes_per_token"] == (3 * 128 - R) * 2
    assert bill["forward_tokens"] == bill["tokens"] + PILOT
