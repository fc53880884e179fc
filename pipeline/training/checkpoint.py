"""Training checkpoints: the drafter (DESIGN 8 export), optimizer, RNG and data position, each in
RUN/checkpoints/step-N (the layout: pipeline/records/run_dir.py).

A checkpoint is written under a hidden temporary name, fsynced, then renamed: a directory named
`step-N` is complete by construction, so a crash mid-write leaves only a temporary that resume
ignores and the next save removes. Loading unpickles nothing: JSON, safetensors, and
`torch.load(weights_only=True)` for the optimizer and RNG tensors.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipeline.files import describe_os_error, fsync_dir, fsync_tree
from pipeline.cache.manifest import Manifest
from pipeline.config import TrainConfig
from pipeline.config.tables import flat_record
from pipeline.drafter.export import ExportDir, export_drafter, read_config, split_head
from pipeline.drafter.vocab import DraftVocab
from pipeline.training.plan import gathered_state
from pipeline.training.step import all_sum
from pipeline.errors import PipelineError
from pipeline.faults import failpoint
from pipeline.records.run_dir import CheckpointDir, RunDir

# Options that may change between a checkpoint and its resume without changing the result
# (bookkeeping, paths, and how the same global batch is split over ranks and micro-batches).
RESUMABLE_CHANGES = {"out", "cache", "cache_local", "cache_local_size", "target", "log_every", "checkpoint_every", "keep_checkpoints", "prefetch",
                     "loader_workers", "allow_mixed_provenance", "allow_incomplete_cache", "micro_batch_sequences",
                     "report_to", "verdict_every"}

STATE_VERSION = 1


def unguarded(before: str) -> None:
    """A write needs no check: no claim (a rank other than 0, a caller outside `pipeline train`)."""


def save_checkpoint(run: Path, *, step: int, drafter, optimizer_state: dict, state: dict, keep: int,
                    guard=unguarded) -> Path:
    """`optimizer_state`: the whole state (plan.gathered_state), as plain AdamW's state_dict().
    `guard(what)` raises when the run no longer owns `run` (RunClaim.check): called before the
    first write and again before the rename that makes the checkpoint visible, since writing a
    large one takes minutes a process may spend paused."""
    guard(f"writing checkpoint step {step}")
    run_dir = RunDir(run)
    root = run_dir.checkpoints
    root.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.checkpoint_temporaries():
        shutil.rmtree(stale, ignore_errors=True)
    final = run_dir.checkpoint(step)
    tmp = run_dir.checkpoint_temporary(step, os.getpid())
    written = CheckpointDir(tmp)
    try:
        tmp.mkdir()
        export_drafter(drafter, written.drafter)
        torch.save(optimizer_state, written.optimizer)
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, written.rng)
        written.trainer_state.write_text(json.dumps({"version": STATE_VERSION, "step": step, **state}, indent=2) + "\n")
        failpoint("checkpoint.written")
        fsync_tree(tmp)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError
        if isinstance(e, OSError):
            reason = describe_os_error(e)
        else:  # torch's writer loses the errno: show what is left on the device instead
            free = shutil.disk_usage(root).free / 2**20
            reason = f"{str(e).splitlines()[0]}; {free:.1f} MiB free on the device"
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit != resource.RLIM_INFINITY:
                reason += f", file size limit (ulimit -f) {limit} bytes"
        shutil.rmtree(tmp, ignore_errors=True)
        raise PipelineError(f"{final}: checkpoint write failed ({reason}); the last complete checkpoint is "
                            "kept: make room, then re-run the same command to resume") from None
    try:
        guard(f"making checkpoint step {step} visible")
    except PipelineError:
        shutil.rmtree(tmp, ignore_errors=True)  # its own temporary: the new owner's next save would remove it
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    failpoint("checkpoint.renamed")
    for old in list_checkpoints(run)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporaries are never listed)."""
    root = RunDir(run).checkpoints
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and RunDir.checkpoint_step(p) is not None]
    return sorted(found, key=RunDir.checkpoint_step)


def read_state(path: Path) -> dict:
    state_file = CheckpointDir(path).trainer_state
    try:
        state = json.loads(state_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PipelineError(f"{state_file}: unreadable ({e})") from None
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise PipelineError(f"{state_file}: unknown trainer state version {state.get('version')!r} "
                            f"(this tool reads version {STATE_VERSION})")
    for key in ("step", "epoch", "position", "config"):
        if key not in state:
            raise PipelineError(f"{state_file}: missing field {key!r}")
    return state


def load_checkpoint(path: Path, *, drafter, optimizer) -> None:
    """Restore drafter, optimizer and RNG in place (the trainer state is `read_state`'s)."""
    from safetensors.torch import load_file

    saved_dir = CheckpointDir(path)
    export = ExportDir(saved_dir.drafter)
    saved = read_config(saved_dir.drafter)
    if saved != drafter.config:
        raise PipelineError(f"{export.config}: the checkpoint's drafter does not match this run's config")
    try:
        weights = load_file(str(export.weights))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for damaged files
        raise PipelineError(f"{export.weights}: unreadable ({e}); delete this checkpoint "
                            "to resume from the one before it") from None
    weights, vocab, _ = split_head(weights, saved_dir.drafter, drafter.config.vocab_size)
    if vocab != drafter.draft_vocab:  # part of the run's identity (DESIGN 3.4)
        raise PipelineError(f"{saved_dir.drafter}: the checkpoint's draft vocabulary ({vocab or 'none'}) is not this run's "
                            f"({drafter.draft_vocab or 'none'}); use the same options and cache, or a new --out")
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    if {k: tuple(v.shape) for k, v in weights.items()} != expected:
        raise PipelineError(f"{export.weights}: names or shapes differ from this run's drafter")
    drafter.load_state_dict(weights)
    try:
        # Mapped, not read: with several ranks each keeps only the state of the parameters it
        # owns (ZeroRedundancyOptimizer), so the rest is never paged in; the optimizer moves
        # what it keeps to its parameters' device.
        optimizer.load_state_dict(torch.load(saved_dir.optimizer, map_location="cpu", mmap=True, weights_only=True))
        rng = torch.load(saved_dir.rng, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable or unsafe file is a clear user error
        raise PipelineError(f"{path}: optimizer or RNG state unreadable ({type(e).__name__}: {e})") from None
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


# --------------------------------------------------------------------------- resume


@dataclass
class Position:
    """Where a run is: steps done, the epoch and the sample position in it, and the totals a
    resumed run carries over."""
    step: int = 0
    epoch: int = 0
    position: int = 0
    elapsed0: float = 0.0
    tokens0: int = 0


def resume_position(out: Path, *, resume: bool, record: dict, identity: dict, drafter, optimizer
                    ) -> tuple[Position, bool]:
    """(where the run starts, whether it resumed): the last checkpoint under `out` loaded into the
    drafter and optimizer when there is one and it may be resumed (same config but for
    RESUMABLE_CHANGES, same cache); a fresh start otherwise. `record`: this run's config, as
    dataclasses.asdict(TrainConfig) (what its checkpoints keep)."""
    found = resumable_checkpoint(out, resume=resume, record=record, identity=identity)
    if found is None:
        return Position(), False
    path, state = found
    load_checkpoint(path, drafter=drafter, optimizer=optimizer)
    return Position(step=state["step"], epoch=state["epoch"], position=state["position"],
                    elapsed0=state.get("elapsed_s", 0.0), tokens0=state.get("tokens_seen", 0)), True


def resumable_checkpoint(out: Path, *, resume: bool, record: dict, identity: dict) -> tuple[Path, dict] | None:
    """(the last checkpoint under `out`, its trainer state) when the run will resume from it; None
    for a fresh start. Refuses, as resume_position does, checkpoints with resume off and a
    checkpoint whose config or cache differ from this run's."""
    found = list_checkpoints(out)
    if not found:
        return None
    if not resume:
        raise PipelineError(f"{out}: has checkpoints up to {found[-1].name}; resume (the default) or choose a new --out")
    state = read_state(found[-1])
    check_resumable(found[-1], state, record, identity)
    return found[-1], state


def saved_draft_vocab(path: Path, vocab_size: int) -> DraftVocab | None:
    """The draft vocabulary a checkpoint's drafter was trained with (its d2t), None without one;
    only that tensor is read."""
    from safetensors import safe_open

    weights = ExportDir(CheckpointDir(path).drafter).weights
    try:
        with safe_open(str(weights), framework="pt") as f:
            d2t = f.get_tensor("d2t") if "d2t" in f.keys() else None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for damaged files
        raise PipelineError(f"{weights}: unreadable ({e}); delete this checkpoint to resume from the one before it") from None
    if d2t is None:
        return None
    try:
        return DraftVocab.from_d2t(d2t, vocab_size)
    except PipelineError as e:
        raise PipelineError(f"{weights}: d2t: {e}") from None


def cache_identity(manifest: Manifest) -> dict:
    """What a checkpoint remembers of its cache: a resume on different data is refused."""
    return {"capture": asdict(manifest.identity.capture), "data": asdict(manifest.identity.data),
            "shards": {name: rec.digest for name, rec in sorted(manifest.shards.items())}}


def check_resumable(path: Path, state: dict, record: dict, identity: dict) -> None:
    # Compared setting by setting: a checkpoint of an older version recorded its config flat.
    saved = flat_record(state["config"], TrainConfig)
    now = flat_record(record, TrainConfig)
    changed = sorted(k for k in now if k not in RESUMABLE_CHANGES and saved.get(k) != now[k])
    if changed:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in changed)
        raise PipelineError(f"{path}: cannot resume, the run's config changed ({detail}); "
                            "use the same options or a new --out")
    if state.get("cache") != identity:
        raise PipelineError(f"{path}: cannot resume, the cache differs from the one this run trained on "
                            "(taps, data or shard digests changed)")


def save_on_all_ranks(out, drafter, optimizer, *, keep: int, record: dict, step, epoch, position, identity, elapsed, tokens, rank, world,
                      device, guard=unguarded):
    """Rank 0 writes the checkpoint (the optimizer state gathered to it first); every rank
    learns whether that failed."""
    failure = None
    optimizer_state = gathered_state(optimizer, rank, world, device)  # a collective: None but on rank 0
    if rank == 0:
        try:
            save_checkpoint(out, step=step, drafter=drafter, optimizer_state=optimizer_state, keep=keep,
                            state={"epoch": epoch, "position": position, "elapsed_s": elapsed, "tokens_seen": tokens,
                                   "world_size": world, "config": record, "cache": identity}, guard=guard)
        except PipelineError as e:
            failure = e
    # Every rank learns whether rank 0's write failed (a full disk, say), so that all stop with
    # the error instead of the others waiting on a collective that rank 0 never joins.
    if world > 1 and all_sum(torch.tensor([int(failure is not None)]), world, device).item() and failure is None:
        raise PipelineError(f"step {step}: rank 0 could not write the checkpoint (its error says why); "
                            "the last complete checkpoint is kept")
    if failure is not None:
        raise failure
