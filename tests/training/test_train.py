"""Stage two: `pipeline train` learns from the cache alone, exactly as it would from the live target."""

import json
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import zarr

from harness.caches import damage_byte, edit_record, manifest_json, resign
from harness.marks import needs_tmpfs
from harness.runs import REPO, cli, cli_here, file_size_limit, in_namespace, small_cache, torchrun
from pipeline.cache.reader import CacheReader
from pipeline.training.batch import anchor_generator, forward_logits, loss_sum, pack, prepare
from pipeline.training.checkpoint import list_checkpoints
from pipeline.drafter.export import load_drafter
from pipeline.drafter.model import DFlashDrafter
from pipeline.errors import PipelineError
from pipeline.target_model import read_target_facts
from pipeline.target_model import frozen_target_modules
from pipeline.training.drafter_shape import drafter_config
from pipeline.training.metrics import block_metrics
from stages.train.run import resolve_config, run_train

DESIGN_KEYS = {"step", "epoch", "loss", "accuracy", "top4_acc", "top8_acc", "avg_streak", "ddtree_streak4",
               "ddtree_streak8", "pos_acc", "lr", "grad_norm", "noise_std", "tok_per_sec", "elapsed_s"}
SAME = ("step", "epoch", "loss", "accuracy", "top4_acc", "avg_streak", "ddtree_streak8", "pos_acc", "lr", "grad_norm")


@pytest.fixture(scope="module")
def cache(tmp_path_factory, train_rows):
    """240 rows without tool schemas (thinking and not): a row's tool schemas make it 3x longer,
    and these tests' step budgets (60 steps to learn a planted mapping) were set for short rows;
    training on rows with tools is covered by the shared trained_run."""
    return small_cache(tmp_path_factory.mktemp("train"), [r for r in train_rows if not r.get("tools")][:240], 2)


def train(cache, out, **overrides):
    cfg, preset_target = resolve_config(None, {"cache": str(cache), "out": str(out), **overrides})
    return run_train(cfg, preset_target=preset_target, warn=lambda *_: None)


def read_log(run):
    return [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]


def test_drafter_learns_and_its_export_reloads(trained_run, tmp_path, embedded):
    """The shared trained drafter (conftest: the tiny preset, log every 10)."""
    cache, steps = trained_run["cache"], trained_run["steps"]
    shutil.copytree(trained_run["run"], tmp_path / "run")  # resumed below: the shared run stays as it is
    lines = read_log(tmp_path / "run")
    assert DESIGN_KEYS <= set(lines[0]) and [x["step"] for x in lines] == [1, *range(10, steps + 1, 10)]
    assert len(lines[-1]["pos_acc"]) == 7  # slots 1..B-1 for the tiny preset's B = 8
    first, last = lines[0], lines[-1]
    assert last["loss"] < 0.5 * first["loss"], (first["loss"], last["loss"])
    assert last["accuracy"] > 0.35 and last["avg_streak"] > 0.5, last  # chance: 1/512 and ~0
    assert json.loads((tmp_path / "run" / "run.json").read_text())["world_size"] == 1
    # The exported drafter (DESIGN 8) is the trained one: reloaded, it scores like the last log line.
    embed, head = frozen_target_modules(embedded.TARGET_DIR)
    drafter = load_drafter(tmp_path / "run" / "drafter", embed=embed, lm_head=head).eval()
    assert drafter.config.target_layer_ids == [1, 3, 5] and drafter.config.block_size == 8
    reader = CacheReader(cache)
    shard = reader.shard(reader.shards[0])
    seqs = [prepare({**shard.sample(int(s)), "sample_id": int(s)}, block_size=8, num_anchors=64, max_length=512,
                    mask_token_id=drafter.config.mask_token_id, gamma=4.0, generator=anchor_generator(0, 0, int(s)))
            for s in shard.sample_ids[:16]]
    packed = pack([s for s in seqs if s is not None], 8)
    with torch.no_grad():
        metrics = block_metrics(forward_logits(drafter, packed), packed.labels, packed.weights)
    assert metrics["accuracy"] > 0.35, metrics
    # A resumed run of a finished training is a no-op that exports the same drafter again.
    exported = (tmp_path / "run" / "drafter" / "model.safetensors").read_bytes()
    again = train(cache, tmp_path / "run", max_steps=steps, log_every=10)
    assert again["resumed"] and again["steps"] == steps and len(read_log(tmp_path / "run")) == len(lines)
    assert (tmp_path / "run" / "drafter" / "model.safetensors").read_bytes() == exported


def live_sample(target, sample, taps):
    """The same sample with features and labels from the live target instead of the cache."""
    ids = torch.from_numpy(sample["input_ids"].astype(np.int64))[None]
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    hidden = torch.stack([out.hidden_states[i + 1][0] for i in taps], dim=1)
    return {**sample, "hidden": hidden, "target_argmax": out.logits[0].argmax(-1).numpy()}


def loss_and_grads(drafter, samples, sids):
    seqs = [prepare(s, block_size=8, num_anchors=512, max_length=512, mask_token_id=drafter.config.mask_token_id,
                    gamma=4.0, generator=anchor_generator(0, 0, sid)) for s, sid in zip(samples, sids)]
    packed = pack(seqs, 8)
    drafter.zero_grad()
    loss = loss_sum(forward_logits(drafter, packed), packed, "ce") / packed.weights.sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}


def test_offline_loss_and_gradients_equal_online(cache, target, embedded):
    """The cache is a faithful substitute for the live target: same samples, same anchors, same
    drafter; the loss and every gradient agree within bf16 storage tolerance."""
    reader = CacheReader(cache)
    taps = manifest_json(cache)["config"]["capture"]["target_layer_ids"]
    shard = reader.shard(reader.shards[1])
    sids = [int(s) for s in shard.sample_ids[:6]]
    cached = [shard.sample(s) for s in sids]
    live = [live_sample(target, s, taps) for s in cached]
    for c, x in zip(cached, live):
        assert np.array_equal(c["target_argmax"], x["target_argmax"])  # labels: the target's own argmax
        torch.testing.assert_close(c["hidden"].float(), x["hidden"], rtol=2**-7, atol=1e-5)  # bf16 rounding only
    cfg, _ = resolve_config(None, {"cache": str(cache)})
    embed, head = frozen_target_modules(embedded.TARGET_DIR)
    config = drafter_config(cfg.drafter, read_target_facts(embedded.TARGET_DIR), embedded.TARGET_DIR, taps)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, embed=embed, lm_head=head)
    offline_loss, offline_grads = loss_and_grads(drafter, cached, sids)
    online_loss, online_grads = loss_and_grads(drafter, live, sids)
    assert offline_loss.item() == pytest.approx(online_loss.item(), rel=5e-3)
    for name, g in offline_grads.items():
        cosine = torch.nn.functional.cosine_similarity(g.flatten(), online_grads[name].flatten(), dim=0)
        assert cosine > 0.995, (name, float(cosine))
        torch.testing.assert_close(g, online_grads[name], rtol=0.05, atol=0.02 * float(online_grads[name].abs().max()))
    # Features rounded to bf16 as the cache stores them: identical inputs, identical loss.
    rounded = [{**x, "hidden": x["hidden"].bfloat16()} for x in live]
    assert loss_and_grads(drafter, rounded, sids)[0].item() == pytest.approx(offline_loss.item(), rel=1e-6)


def plant(cache, out, *, shift: int, alphabet=32, seed=0):
    """A copy of `cache` whose content is synthetic: random tokens from a small alphabet, random
    features, and a planted target that predicts perm[token at t + shift] at position t."""
    shutil.copytree(cache, out)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(alphabet) + 100
    reader = CacheReader(out)
    for name in reader.shards:
        group = zarr.open_group(str(out / name), mode="r+", zarr_format=3)
        offsets = group["offsets"][:]
        n = int(offsets[-1])
        tokens = rng.integers(0, alphabet, n)
        planted = np.empty(n, dtype=np.int64)
        for a, b in zip(offsets[:-1], offsets[1:]):
            planted[a:b] = perm[np.roll(tokens[a:b], -shift)]
        group["input_ids"][:] = (tokens + 100).astype(group["input_ids"].dtype)
        group["loss_mask"][:] = 1
        group["target_argmax"][:] = planted.astype(group["target_argmax"].dtype)
        noise = torch.randn(group["hidden"].shape, generator=torch.Generator().manual_seed(seed)).bfloat16()
        group["hidden"][:] = noise.view(torch.int16).numpy().view(np.uint16)
        resign(out, name)  # the commit record matches the synthetic content
    return out


def test_label_alignment_planted_vs_shifted_by_one(cache, tmp_path):
    """Label of slot 1 = target_argmax[a] (DESIGN 3.3). With the planted target predicting
    perm[token at t], slot 1 is learnable from the anchor token alone; shift the stored labels by
    one position and the information is gone, so the same training stays at chance."""
    options = {"max_steps": 60, "log_every": 60, "block_size": 2, "num_anchors": 64, "lr": 1e-2}
    train(plant(cache, tmp_path / "planted", shift=0), tmp_path / "a", **options)
    train(plant(cache, tmp_path / "shifted", shift=1), tmp_path / "b", **options)
    good, bad = read_log(tmp_path / "a")[-1], read_log(tmp_path / "b")[-1]
    assert good["accuracy"] > 0.95, good
    assert bad["accuracy"] < 0.15, bad


# These runs test resuming, not learning: a small step (2 sequences, 32 anchors) keeps their 30
# steps cheap; the checkpoint (model and optimizer) is as large as in any tiny-preset run.
RUN = ["--max-steps", "30", "--log-every", "1", "--checkpoint-every", "10", "--num-anchors", "32",
       "--batch-sequences", "2", "--micro-batch-sequences", "2", "--json"]


@pytest.fixture(scope="module")
def uninterrupted(cache, tmp_path_factory):
    run = tmp_path_factory.mktemp("whole") / "run"
    whole = cli("train", "--cache", str(cache), "--out", str(run), *RUN)
    assert whole.returncode == 0, whole.stderr
    return run


def assert_resumed_identically(run, whole):
    a, b = read_log(whole), read_log(run)
    assert [x["step"] for x in b] == list(range(1, 31))
    for x, y in zip(a, b):
        assert {k: x[k] for k in SAME} == {k: y[k] for k in SAME}, x["step"]
    assert (run / "drafter" / "model.safetensors").read_bytes() == (whole / "drafter" / "model.safetensors").read_bytes()


def test_resume_after_kill_continues_identically(cache, tmp_path, uninterrupted):
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "cli", "train", "--cache", str(cache), "--out", str(run), *RUN],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        log = run / "train_log.jsonl"
        if (run / "checkpoints" / "step-00000010").is_dir() and log.exists() and len(log.read_text().splitlines()) >= 13:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = read_log(run)
    assert 13 <= len(killed) < 30, "the run was not interrupted between checkpoints"
    resumed = cli("train", "--cache", str(cache), "--out", str(run), *RUN)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["resumed"] is True
    assert_resumed_identically(run, uninterrupted)


@pytest.mark.parametrize("failpoint, complete, resumes_from", [
    ("checkpoint.written@2", ["step-00000010"], 10),                    # files written, not fsynced or renamed
    ("checkpoint.renamed@2", ["step-00000010", "step-00000020"], 20),   # renamed, older ones not yet pruned
])
def test_kill_9_during_a_checkpoint_write(cache, tmp_path, uninterrupted, failpoint, complete, resumes_from):
    run = tmp_path / "killed"
    killed = cli("train", "--cache", str(cache), "--out", str(run), *RUN,
                 env={"PIPELINE_FAILPOINT": failpoint})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [p.name for p in list_checkpoints(run)] == complete
    half_written = list((run / "checkpoints").glob(".step-*.tmp-*"))
    assert bool(half_written) == (resumes_from == 10)
    resumed = cli("train", "--cache", str(cache), "--out", str(run), *RUN)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["resumed"] is True and summary["resumed_from_step"] == resumes_from, summary
    assert not list((run / "checkpoints").glob(".step-*.tmp-*"))
    assert_resumed_identically(run, uninterrupted)


@needs_tmpfs
def test_disk_full_during_a_checkpoint_write(cache, tmp_path, uninterrupted):
    """The run directory is on an 8 MiB tmpfs: the step-10 checkpoint (~5 MiB) fits, step 20's
    does not. The error names the checkpoint, the half-written one is removed, and once the
    filesystem is grown the same command resumes from step 10 to an identical result."""
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    train = " ".join([sys.executable, "-m", "cli", "train", "--cache", str(cache), "--out", str(mnt / "run"), *RUN])
    in_namespace(f"""
mount -t tmpfs -o size=8m tmpfs {mnt}
{train} > /dev/null 2> {out}/full.err
echo $? > {out}/full.rc
ls -a {mnt}/run/checkpoints > {out}/after-failure.txt
mount -o remount,size=64m {mnt}
{train} > {out}/resumed.json 2> {out}/resumed.err || exit 11
cp -r {mnt}/run {out}/run
""", out)
    assert (out / "full.rc").read_text().strip() == "1"
    errors = [line for line in (out / "full.err").read_text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "step-00000020: checkpoint write failed" in errors[0], errors
    assert "free on the device" in errors[0] or "no space left" in errors[0], errors
    assert (out / "after-failure.txt").read_text().split() == [".", "..", "step-00000010"]
    summary = json.loads((out / "resumed.json").read_text())
    assert summary["resumed_from_step"] == 10, summary
    assert_resumed_identically(out / "run", uninterrupted)


def test_a_failed_checkpoint_write_stops_every_rank(cache, tmp_path):
    """Rank 0 alone writes checkpoints; when it cannot (here a 2 MB file-size limit against a
    3 MB optimizer state), every rank stops with the error instead of waiting for rank 0."""
    run = tmp_path / "run"
    result = torchrun(2, "train", "--cache", str(cache), "--out", str(run), "--max-steps", "4", "--checkpoint-every", "2",
                      "--micro-batch-sequences", "2", preexec_fn=file_size_limit(2_000_000), timeout=300)
    assert result.returncode != 0
    assert "step-00000002: checkpoint write failed" in result.stderr and "ulimit -f" in result.stderr, result.stderr[-3000:]
    assert "step 2: rank 0 could not write the checkpoint" in result.stderr, result.stderr[-3000:]
    assert not list((run / "checkpoints").iterdir())


def test_a_damaged_checkpoint_is_a_clear_error(cache, tmp_path, uninterrupted):
    run = tmp_path / "damaged"
    shutil.copytree(uninterrupted, run)
    latest = list_checkpoints(run)[-1]
    weights = latest / "drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    (run / "drafter").rename(run / "drafter-old")  # make the run look unfinished
    result = cli("train", "--cache", str(cache), "--out", str(run), *RUN[:-1])
    assert result.returncode == 1
    assert f"{weights}: unreadable" in result.stderr and "Traceback" not in result.stderr, result.stderr


TWO_PROCESS = ["--max-steps", "12", "--log-every", "1", "--checkpoint-every", "6", "--num-anchors", "64",
               "--micro-batch-sequences", "2", "--json"]


@pytest.fixture(scope="module")
def two_process_run(cache, tmp_path_factory):
    run = tmp_path_factory.mktemp("two") / "run"
    two = torchrun(2, "train", "--cache", str(cache), "--out", str(run), *TWO_PROCESS)
    assert two.returncode == 0, two.stderr[-3000:]
    return run, json.loads(two.stdout)


@pytest.fixture(scope="module")
def one_process_run(cache, tmp_path_factory):
    run = tmp_path_factory.mktemp("one") / "run"
    one = cli("train", "--cache", str(cache), "--out", str(run), *TWO_PROCESS, env={"OMP_NUM_THREADS": "1"})
    assert one.returncode == 0, one.stderr
    return run


def _same_run(a: list[dict], b: list[dict]) -> None:
    """Two logs of the same steps agree to float32 reduction order (ranks sum gradients in
    another order than one process does)."""
    assert [x["step"] for x in a] == [y["step"] for y in b]
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5), x["step"]
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4), x["step"]
        assert x["accuracy"] == pytest.approx(y["accuracy"], abs=1e-6), x["step"]
        assert (x["epoch"], x["lr"]) == (y["epoch"], y["lr"]), x["step"]


def test_two_process_ddp_matches_one_process(cache, two_process_run, one_process_run):
    """Two ranks (DDP, AdamW state sharded by ZeroRedundancyOptimizer) log what one process logs."""
    run, summary = two_process_run
    assert summary["world_size"] == 2
    assert "sharded over 2 ranks" in json.loads((run / "run.json").read_text())["optimizer"]
    _same_run(read_log(one_process_run), read_log(run))


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resume_on_another_number_of_ranks(cache, tmp_path, two_process_run, one_process_run, before, after):
    """A run checkpointed at step 6 on `before` ranks and resumed on `after` ranks logs steps 7-12
    as the uninterrupted run on `after` ranks logs them: the global batch (batch_sequences, split
    over the ranks by position), the data order (a function of seed and epoch only), the optimizer
    state (consolidated on save, re-split on load) and the RNG do not depend on the world size."""
    source = two_process_run[0] if before == 2 else one_process_run
    reference = two_process_run[0] if after == 2 else one_process_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    shutil.rmtree(run / "checkpoints" / "step-00000012")
    shutil.rmtree(run / "drafter")
    if after == 2:
        resumed = torchrun(2, "train", "--cache", str(cache), "--out", str(run), *TWO_PROCESS)
    else:
        resumed = cli("train", "--cache", str(cache), "--out", str(run), *TWO_PROCESS, env={"OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record = json.loads((run / "run.json").read_text())
    assert (record["resumed_from_step"], record["world_size"]) == (6, after)
    log = read_log(run)
    assert [x["step"] for x in log] == list(range(1, 13))
    assert log[:6] == read_log(source)[:6]  # the steps before the checkpoint are the first run's, kept
    _same_run(log[6:], read_log(reference)[6:])


def test_two_process_resume_is_exact(cache, tmp_path, two_process_run):
    """Resumed on two ranks from the step-6 checkpoint (the sharded optimizer state consolidated on
    rank 0, split again on load), the run ends byte-identical to the uninterrupted one."""
    whole, _ = two_process_run
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    shutil.rmtree(run / "checkpoints" / "step-00000012")
    shutil.rmtree(run / "drafter")
    resumed = torchrun(2, "train", "--cache", str(cache), "--out", str(run), *TWO_PROCESS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run / "run.json").read_text())["resumed_from_step"] == 6
    a, b = read_log(whole), read_log(run)
    assert [x["step"] for x in b] == list(range(1, 13))
    for x, y in zip(a, b):
        assert {k: x[k] for k in SAME} == {k: y[k] for k in SAME}, x["step"]
    assert (run / "drafter" / "model.safetensors").read_bytes() == (whole / "drafter" / "model.safetensors").read_bytes()


def test_soft_kl_and_noise_options_train(cache, tmp_path):
    train(cache, tmp_path / "kl", max_steps=40, warmup_steps=5, log_every=1, loss="kl", noise_std=0.05)
    lines = read_log(tmp_path / "kl")
    # The last five steps, not the last one: batches of thinking and plain rows swing one step's
    # accuracy between 0.12 and 0.21 on their own.
    last = lines[-5:]
    assert sum(x["loss"] for x in last) / 5 < 0.6 * lines[0]["loss"]
    assert sum(x["accuracy"] for x in last) / 5 > 0.15
    assert {x["noise_std"] for x in lines} == {0.05}


def test_refuses_a_cache_that_does_not_fit(cache, tmp_path, embedded):
    with pytest.raises(PipelineError, match=r"target_layer_ids: cache \[1, 3, 5\] vs drafter config \[1, 2, 5\]"):
        train(cache, tmp_path / "r1", target_layer_ids=[1, 2, 5], max_steps=1)
    with pytest.raises(PipelineError, match="hidden_size: cache 128 vs preset 'qwen3.6-27b' 5120"):
        train(cache, tmp_path / "r2", preset="qwen3.6-27b", max_steps=1)
    other = tmp_path / "other-target"
    shutil.copytree(embedded.TARGET_DIR, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["model_max_length"] = 123
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(PipelineError, match="tokenizer files sha256"):
        train(cache, tmp_path / "r3", target=str(other), max_steps=1)
    for run in ("r1", "r2", "r3"):
        assert not (tmp_path / run / "checkpoints").exists()


def test_mixed_kernel_provenance_needs_the_flag(cache, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(cache, mixed)
    name = sorted(manifest_json(mixed)["shards"])[1]
    edit_record(mixed, name, lambda record: record["kernels"].update(path="fla"))
    refused = cli("train", "--cache", str(mixed), "--out", str(tmp_path / "run"), "--max-steps", "2")
    assert refused.returncode == 1
    assert "mixed kernel provenance" in refused.stderr and "--allow-mixed-provenance" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    allowed = cli_here("train", "--cache", str(mixed), "--out", str(tmp_path / "run"), "--max-steps", "2",
                       "--allow-mixed-provenance")
    assert allowed.returncode == 0, allowed.stderr
    assert "warning" in allowed.stderr and "mixed kernel provenance" in allowed.stderr
    assert "accuracy" in allowed.stdout and "drafter" in allowed.stdout  # the human summary table


def test_a_corrupted_chunk_stops_training_with_a_clear_error(cache, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(cache, bad)
    chunk = bad / "shard-00001" / "hidden" / "c.0.0.0"
    damage_byte(chunk, chunk.stat().st_size // 2)
    result = cli_here("train", "--cache", str(bad), "--out", str(tmp_path / "run"), "--max-steps", "40")
    assert result.returncode == 1
    assert f"{bad}/shard-00001/hidden: read of sample" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_resume_refuses_a_changed_config(cache, tmp_path):
    train(cache, tmp_path / "run", max_steps=2, checkpoint_every=1)
    with pytest.raises(PipelineError, match=r"cannot resume, the run's config changed \(lr: 0.003 -> 0.001\)"):
        train(cache, tmp_path / "run", max_steps=2, lr=1e-3)
    fresh = cli_here("train", "--cache", str(cache), "--out", str(tmp_path / "run"), "--max-steps", "2", "--no-resume")
    assert fresh.returncode == 1 and "has checkpoints up to step-00000002" in fresh.stderr


def test_bf16_autocast_trains_and_is_recorded(cache, tmp_path):
    result = train(cache, tmp_path / "bf16", max_steps=12, warmup_steps=2, log_every=1, dtype="bfloat16")
    assert result["autocast"] == "torch.bfloat16"
    assert json.loads((tmp_path / "bf16" / "run.json").read_text())["autocast"] == "torch.bfloat16"
    losses = [x["loss"] for x in read_log(tmp_path / "bf16")]
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses
    # DESIGN 8: the export is in the training dtype, recorded.
    assert json.loads((tmp_path / "bf16" / "drafter" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_sliding_window_layers_train_and_export(cache, tmp_path, embedded):
    """A sliding-window layer then a full one (the flagship's layout, scaled down): it learns, the
    attention path is recorded, and the export carries the layer kinds back into the same config."""
    kinds = ["sliding_attention", "full_attention"]
    train(cache, tmp_path / "swa", max_steps=30, warmup_steps=3, log_every=1, num_hidden_layers=2, layer_types=kinds,
          sliding_window=24)
    lines = read_log(tmp_path / "swa")
    assert lines[-1]["loss"] < 0.7 * lines[0]["loss"], (lines[0]["loss"], lines[-1]["loss"])
    run = json.loads((tmp_path / "swa" / "run.json").read_text())
    assert run["attention_path"] == "split" and run["drafter"]["layer_types"] == kinds
    embed, head = frozen_target_modules(embedded.TARGET_DIR)
    drafter = load_drafter(tmp_path / "swa" / "drafter", embed=embed, lm_head=head)
    assert drafter.config.layer_types == kinds and drafter.config.sliding_window == 24
    with pytest.raises(PipelineError, match="drafter config: sliding_attention layers need sliding_window"):
        train(cache, tmp_path / "bad1", max_steps=1, num_hidden_layers=2, layer_types=kinds)
    with pytest.raises(PipelineError, match="drafter config: layer_types has 2 entries for 3 layers"):
        train(cache, tmp_path / "bad2", max_steps=1, num_hidden_layers=3, layer_types=kinds, sliding_window=8)
    refused = cli_here("train", "--cache", str(cache), "--out", str(tmp_path / "bad3"), "--max-steps", "1",
                       "--attention", "flex")
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "attention 'flex' needs a CUDA device" in refused.stderr
    for bad in ("bad1", "bad2", "bad3"):
        assert not (tmp_path / bad / "checkpoints").exists()
