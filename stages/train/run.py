"""Stage two: `pipeline train --cache DIR` trains a DFlash drafter from the cache alone.

The target's weights are read only for the frozen embedding and lm_head. One optimizer step
takes `batch_sequences` samples in the epoch order of `pipeline.training.stream` (a pure function
of the shards, seed and epoch); rank r of W reads positions r, r+W, ..., so the same global
batch forms whatever W is; `pipeline.training.step` runs each step (global loss normalisation,
micro-batches, DDP). This module resolves the configuration, builds the drafter and its optimizer
from the cache and the target, and hands them to the loop (pipeline/training/loop.py), which logs
(log_line.py) and checkpoints (checkpoint.py).

Resume is exact: a checkpoint holds the drafter, optimizer, RNG and the data position (epoch,
position); anchors come from (seed, epoch, sample id) and noise from (seed, step, sample id), so
a resumed run logs the same losses as an uninterrupted one.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.allocator import keep_freed_buffers_mapped
from pipeline.cache.manifest import describe_missing
from pipeline.cache.reader import open_cache
from pipeline.config import Data, Job, TrainConfig
from pipeline.devices import dtype_name, resolve_device
from pipeline.distributed import elastic_restart_hazard, first_launch, init_data_parallel
from pipeline.drafter.export import export_drafter
from pipeline.drafter.model import DFlashDrafter, attention_path
from pipeline.errors import PipelineError
from pipeline.projection.basis_file import cache_basis
from pipeline.records.run import RunRecord, write_run_record
from pipeline.records.run_dir import RunDir
from pipeline.records.train_log import read_train_log, trim_to_step
from pipeline.report.live import LiveVerdicts
from pipeline.target_model import (
    frozen_target_modules,
    identity_claims,
    read_target_facts,
    recorded_in_cache,
    resolve_target,
)
from pipeline.tracking import Trackers, open_trackers, tracker_class
from pipeline.training.blocks import default_gamma
from pipeline.training.checkpoint import cache_identity, resume_position, unguarded
from pipeline.training.compat import check_compatible, kernel_paths
from pipeline.training.drafter_shape import drafter_config
from pipeline.training.mask_token import check_mask_absent
from pipeline.training.loop import train_loop
from pipeline.training.loss import LOSS_PATH
from pipeline.training.objectives import describe_slot_weights
from pipeline.training.plan import describe_optimizer, make_optimizer, make_plan
from pipeline.training.run_claim import ClaimLost, claim_for_job
from pipeline.training.run_vocab import run_draft_vocab
from pipeline.training.step import StepRunner, autocast_dtype
from pipeline.training.configure import resolve_config  # noqa: F401 (train's entry point, for demo and the tests)


def check_complete(data: Data, manifest, warn) -> dict:
    """The manifest's missing shards; an incomplete cache is refused unless allowed (then warned)."""
    incomplete = manifest.missing_shards()
    if incomplete["missing"]:
        if not data.allow_incomplete_cache:
            raise PipelineError(f"{data.cache}: incomplete cache: {describe_missing(incomplete)}; finish the "
                                "extraction, or pass --allow-incomplete-cache to train on what is there")
        warn(f"training on an incomplete cache (--allow-incomplete-cache): {describe_missing(incomplete)}")
    return incomplete


def new_drafter(job: Job, config, embed, head, device, vocab=None) -> tuple[DFlashDrafter, str]:
    """(a freshly initialised drafter on `device`, seeded by the job's seed; its attention path)."""
    torch.manual_seed(job.seed)
    drafter = DFlashDrafter(config, embed=embed, lm_head=head, draft_vocab=vocab).to(device)
    drafter.attention = job.attention
    path = attention_path(job.attention, device)
    if path == "flex" and device.type != "cuda":
        raise PipelineError(f"attention 'flex' needs a CUDA device (torch has no flex attention backward on {device.type}); "
                            "use 'auto' or 'split'")
    return drafter, path


def run_train(cfg: TrainConfig, *, preset_target: dict | None = None, resume: bool = True, view=None,
              warn=print) -> dict:
    """Train; returns a summary. `view` receives progress (None: silent). The run directory is
    claimed first, once for all ranks, and given back however the run ends (run_claim.py)."""
    rank, world = init_data_parallel()
    claim = claim_for_job(Path(cfg.job.out), rank=rank, world=world, warn=warn)
    guard = claim.check if claim is not None else unguarded  # rank 0 checks before each of its writes
    try:
        return _train(cfg, rank, world, preset_target=preset_target, resume=resume, view=view, warn=warn, guard=guard)
    finally:
        if claim is not None:
            claim.release()


def describe_run(cfg: TrainConfig, reader, target_dir: Path, facts, *, world: int, device, frozen_dtype, gamma: float,
                 attention_path: str, vocab_record, plan, config, incomplete: dict, resumed_from_step: int) -> RunRecord:
    """What RUN/run.json says of this run: its config, target, cache, placement and plan."""
    manifest = reader.manifest
    return RunRecord(
        config=asdict(cfg), target=str(target_dir), target_config_sha256=facts.config_sha256,
        target_weights=manifest.identity.target.weights,   # the weights whose predictions the drafter learns
        cache=reader.location.where() if reader.location.remote else str(Path(cfg.data.cache).resolve()),
        world_size=world, device=str(device), autocast=str(autocast_dtype(cfg.job.dtype, device)),
        frozen_dtype=dtype_name(frozen_dtype), loss_path=LOSS_PATH,
        slot_weights=describe_slot_weights(cfg.objective.position_weight, gamma, cfg.objective.dpace_alpha),
        attention_path=attention_path, draft_vocab=vocab_record,
        tap_projection=None if manifest.identity.capture.projection is None
        else asdict(manifest.identity.capture.projection),
        optimizer=describe_optimizer(world),
        plan=asdict(plan), drafter=asdict(config), kernels=list(kernel_paths(manifest)),
        incomplete_cache=incomplete if incomplete["missing"] else None,
        resumed_from_step=resumed_from_step)


def _train(cfg: TrainConfig, rank: int, world: int, *, preset_target: dict | None, resume: bool, view, warn,
           guard) -> dict:
    for name in cfg.tracking.report_to:  # a missing extra is one line before anything loads
        tracker_class(name).check_installed()
    hazard = elastic_restart_hazard()
    if hazard and rank == 0 and first_launch():
        warn(hazard)
    device, _ = resolve_device("auto", "auto")
    keep_freed_buffers_mapped()  # this process decodes every sample (or forks the loaders that do)
    data = cfg.data
    reader = open_cache(data.cache, data.cache_local, data.cache_local_size)
    manifest = reader.manifest
    target_dir = resolve_target(cfg.job.target, recorded_in_cache(manifest))
    facts = read_target_facts(target_dir)
    # The weights decide the frozen embedding and lm_head; config.json may be re-saved, so it is not compared.
    check_compatible(manifest, target=str(target_dir), target_claims=identity_claims(target_dir, weights=True, config=False),
                     taps=cfg.drafter.target_layer_ids, preset_target=preset_target, preset_name=cfg.job.preset,
                     allow_mixed_provenance=data.allow_mixed_provenance, warn=warn if rank == 0 else (lambda *_: None))
    incomplete = check_complete(data, manifest, warn if rank == 0 else (lambda *_: None))
    # A projected cache: fc reads its R values a token; the export folds the basis back (pipeline/projection).
    basis = cache_basis(reader)
    config = drafter_config(cfg.drafter, facts, target_dir, list(manifest.identity.capture.target_layer_ids),
                            projected_rank=None if basis is None else basis.projected_rank)
    check_mask_absent(reader, config.mask_token_id)
    frozen_dtype = autocast_dtype(cfg.job.dtype, device) or torch.float32
    run_config = asdict(cfg)  # what run.json, each checkpoint and the trackers record
    # Counted on rank 0 alone and sent to the others; on resume, the checkpoint's (run_vocab.py)
    vocab, vocab_record = run_draft_vocab(cfg.drafter.draft_vocab, reader, target_dir, max_length=data.max_length,
                                          out=Path(cfg.job.out), run_config=run_config, vocab_size=facts.vocab_size,
                                          mask_id=config.mask_token_id, resume=resume, rank=rank, world=world,
                                          warn=warn)
    embed, head = frozen_target_modules(target_dir, frozen_dtype)
    drafter, path = new_drafter(cfg.job, config, embed, head, device, vocab)
    if basis is not None:
        drafter.use_basis(basis)
    del head  # with a draft vocabulary the drafter keeps only its K rows
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg.optimizer, world)
    plan = make_plan(cfg.schedule, cfg.optimizer, sum(manifest.shards[s].samples for s in reader.shards), world)
    out = Path(cfg.job.out)
    identity = cache_identity(manifest)
    gamma = cfg.objective.gamma or default_gamma(config.block_size)

    at, resumed = resume_position(out, resume=resume, record=run_config, identity=identity, drafter=drafter,
                                  optimizer=optimizer)
    start_step = at.step
    if rank == 0:
        guard("writing run.json")
        out.mkdir(parents=True, exist_ok=True)
        trim_to_step(RunDir(out).train_log, at.step)
        trim_to_step(RunDir(out).verdicts, at.step)
        write_run_record(out, describe_run(cfg, reader, target_dir, facts, world=world, device=device,
                                           frozen_dtype=frozen_dtype, gamma=gamma, attention_path=path,
                                           vocab_record=vocab_record, plan=plan, config=config, incomplete=incomplete,
                                           resumed_from_step=at.step))

    trainer = StepRunner(plan, drafter, optimizer, params, device, rank, world, objective=cfg.objective,
                         optimization=cfg.optimizer, data=data, seed=cfg.job.seed, dtype=cfg.job.dtype, gamma=gamma,
                         noise_scale=None if basis is None else 1.0 / basis.scales)
    if world > 1:
        # Gradients as views of DDP's all-reduce buckets: one copy of them instead of two (1.8 GB a
        # rank for one drafter layer at hidden 5120); the update is the same.
        trainer.model = torch.nn.parallel.DistributedDataParallel(
            drafter, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)

    verdicts = LiveVerdicts(total_steps=plan.total_steps, warmup_steps=plan.warmup_steps, peak_lr=cfg.optimizer.lr,
                            vocab_size=config.draft_vocab_size or config.vocab_size, every=cfg.tracking.verdict_every)
    trackers = Trackers([])
    log_file = None
    if rank == 0:
        for line in read_train_log(RunDir(out).train_log):  # a resumed run: the causes that fired before stay fired
            verdicts.observe(line)
        if cfg.tracking.report_to:
            trackers = open_trackers(cfg.tracking.report_to, run_dir=out, run_name=out.resolve().name, start_step=at.step,
                                     params={"config": run_config, "cache": identity, "plan": asdict(plan),
                                             "drafter": asdict(config), "world_size": world}, warn=warn)
        log_file = open(RunDir(out).train_log, "a", encoding="utf-8")
    t_start = time.perf_counter()
    if view:
        view.start(total=plan.total_steps, done=at.step)
    lost = False
    try:
        result = train_loop(plan, reader, trainer, at, data=data, schedule=cfg.schedule, record=run_config, out=out, identity=identity, trackers=trackers,
                            verdicts=verdicts, log_file=log_file, view=view, warn=warn, guard=guard)
        if rank == 0:
            guard("writing the export (drafter/)")
            drafter.eval()
            export_drafter(drafter, RunDir(out).drafter, dtype=autocast_dtype(cfg.job.dtype, device), basis=basis)
            trackers.artifact(RunDir(out).drafter)
    except ClaimLost:
        lost = True  # the directory is another run's now: the trackers' closing writes would land in it
        raise
    finally:
        if log_file:
            log_file.close()
        trackers.abandon() if lost else trackers.close()
        if view:
            view.stop()
    last = result.last or next(reversed(read_train_log(RunDir(out).train_log)), None)
    if world > 1:
        dist.barrier()
    return {"steps": at.step, "total_steps": plan.total_steps, "epochs": round(at.step / plan.steps_per_epoch, 3),
            "last": last.to_json() if last else {}, "out": str(out), "drafter": str(RunDir(out).drafter), "world_size": world,
            "device": str(device), "autocast": str(autocast_dtype(cfg.job.dtype, device)),
            "wall_s": round(time.perf_counter() - t_start, 2), "resumed": resumed,
            "verdicts": [v.line() for v in result.fired], "report_to": cfg.tracking.report_to,
            "resumed_from_step": start_step if resumed else None, "draft_vocab": describe_draft_vocab(vocab_record)}


def describe_draft_vocab(record: dict | None) -> str | None:
    """The draft vocabulary in the summary's words (None: the target's whole vocabulary)."""
    if record is None:
        return None
    return f"{record['size']:,} of {record['target_size']:,} tokens, covering {record['coverage']:.2%} of the labels"
