"""Stage two: `pipeline train --cache DIR` trains a DFlash drafter from the cache alone.

The target's weights are read only for the frozen embedding and lm_head. One optimizer step
takes `batch_sequences` samples in the epoch order of `pipeline.drafter.stream` (a pure function
of the shards, seed and epoch); rank r of W reads positions r, r+W, ..., so the same global
batch forms whatever W is; `pipeline.drafter.step` runs each step (global loss normalisation,
micro-batches, DDP). This module resolves the configuration and runs the loop, logs and
checkpoints.

Resume is exact: a checkpoint holds the drafter, optimizer, RNG and the data position (epoch,
position); anchors come from (seed, epoch, sample id) and noise from (seed, step, sample id), so
a resumed run logs the same losses as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.cache.files import write_json_atomic
from pipeline.cache.manifest import Manifest, describe_missing, read_manifest
from pipeline.cache.reader import CacheReader
from pipeline.cache.sharded import keep_sample_buffers_mapped
from pipeline.config import TrainConfig, load_config, read_config_file
from pipeline.distributed import elastic_restart_hazard
from pipeline.drafter.blocks import default_gamma
from pipeline.drafter.checkpoint import list_checkpoints, load_checkpoint, read_state, save_checkpoint
from pipeline.drafter.compat import PRESET_FIELDS, check_compatible, kernel_paths
from pipeline.drafter.export import export_drafter
from pipeline.drafter.loss import LOSS_PATH
from pipeline.drafter.model import DFlashDrafter, DrafterConfig, attention_path
from pipeline.drafter.step import StepRunner, all_sum, autocast_dtype
from pipeline.drafter.stream import SampleStream, StreamState
from pipeline.errors import PipelineError
from pipeline.report.live import LiveVerdicts, Verdict
from pipeline.tracking import Trackers, open_trackers, tracker_class
from pipeline.target import TargetFacts, identity_claims, read_target_facts, resolve_target

# Options that may change between a checkpoint and its resume without changing the result
# (bookkeeping, paths, and how the same global batch is split over ranks and micro-batches).
RESUMABLE_CHANGES = {"out", "cache", "cache_local", "cache_local_size", "target", "log_every", "checkpoint_every", "keep_checkpoints", "prefetch",
                     "loader_workers", "allow_mixed_provenance", "allow_incomplete_cache", "micro_batch_sequences",
                     "report_to", "verdict_every"}


# --------------------------------------------------------------------------- configuration


def match_preset(cache: str | Path) -> str | None:
    """The preset whose [target] (layers, hidden size, vocab) matches the cache's target."""
    from manifests import load_preset, preset_names

    manifest = read_manifest(cache)
    if manifest is None:
        return None
    for name in preset_names():
        target = load_preset(name).get("target", {})
        if not manifest.identity.differences({f"capture.{k}": target.get(k) for k in PRESET_FIELDS}):
            return name
    return None


def resolve_config(path: Path | None, overrides: dict) -> tuple[TrainConfig, dict | None]:
    """TrainConfig from defaults < preset < TOML `[train]` < CLI; and the preset's [target] table."""
    from manifests import load_preset

    chosen = {**read_config_file(TrainConfig, path, section="train"), **{k: v for k, v in overrides.items() if v is not None}}
    name = chosen.get("preset") or match_preset(chosen.get("cache", TrainConfig.cache))
    base, preset_target = {}, None
    if name:
        preset = load_preset(name)
        preset_target = preset.get("target", {})
        base = {k: v for k, v in preset_target.items() if k in ("target_layer_ids", "mask_token")}
        base.update(preset.get("drafter", {}))
        base["preset"] = name
    return load_config(TrainConfig, path, overrides, section="train", base=base), preset_target


def frozen_target_modules(target_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    """The target's embed_tokens and lm_head, read from its safetensors (nothing else is loaded),
    in `dtype` once (the compute dtype: bf16 halves their 5 GB each at the flagship vocabulary and
    nothing casts them per step)."""
    from safetensors import safe_open

    index = target_dir / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    wanted = {"embed": ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
              "lm_head": ("lm_head.weight",)}
    found = {}
    for role, names in wanted.items():
        for name in names:
            path = target_dir / (files.get(name, "") if files else "model.safetensors")
            if not path.is_file():
                continue
            with safe_open(str(path), "pt") as f:
                if name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    found[role] = f.get_tensor(name).to(dtype)
                    break
    if "embed" not in found:
        raise PipelineError(f"{target_dir}: no embed_tokens weight in the target's safetensors")
    weight = found["embed"]
    embed = torch.nn.Embedding.from_pretrained(weight, freeze=True)
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = torch.nn.Parameter(found.get("lm_head", weight), requires_grad=False)  # tied if absent
    return embed, head


def drafter_config(cfg: TrainConfig, facts: TargetFacts, target_dir: Path, taps: list[int]) -> DrafterConfig:
    text = json.loads((target_dir / "config.json").read_text())
    text = text.get("text_config") or text
    heads = cfg.num_attention_heads or facts.num_attention_heads
    try:
        return DrafterConfig(
            hidden_size=facts.hidden_size, intermediate_size=cfg.intermediate_size or int(text["intermediate_size"]),
            num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=heads,
            num_key_value_heads=cfg.num_key_value_heads or (facts.num_key_value_heads if not cfg.num_attention_heads else heads),
            head_dim=cfg.head_dim or int(text.get("head_dim") or facts.hidden_size // facts.num_attention_heads),
            vocab_size=facts.vocab_size, target_layer_ids=list(taps), num_target_layers=facts.num_hidden_layers,
            mask_token_id=mask_token_id(cfg.mask_token, target_dir, facts), block_size=cfg.block_size,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=cfg.rope_theta or float(text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta")
                                               or 10000.0),
            max_position_embeddings=cfg.max_position_embeddings or int(text.get("max_position_embeddings", 32768)),
            layer_types=cfg.layer_types, sliding_window=cfg.sliding_window)
    except ValueError as e:
        raise PipelineError(f"drafter config: {e}") from None


def mask_token_id(mask_token: str | int, target_dir: Path, facts: TargetFacts) -> int:
    """The mask id (DESIGN 2): an integer id, or a token string looked up in the target's
    tokenizer; it must have an embedding row and be a reserved token (special or added) or a row
    past the tokenizer's vocabulary, never an ordinary token that text produces."""
    from pipeline.target import load_tokenizer, reserved_token_ids

    tokenizer = load_tokenizer(target_dir)
    if isinstance(mask_token, str):
        if mask_token not in tokenizer.get_vocab():
            raise PipelineError(f"{target_dir}: the tokenizer has no mask token {mask_token!r}: pass --mask-token ID|TOKEN "
                                f"(or mask_token in the [train] table of --config){suggest_mask_token(tokenizer, facts)}")
        mask_id = int(tokenizer.convert_tokens_to_ids(mask_token))
    else:
        mask_id = int(mask_token)
    if not 0 <= mask_id < facts.vocab_size:
        raise PipelineError(f"{target_dir}: mask token {mask_token!r} id {mask_id} has no embedding row "
                            f"(vocab_size {facts.vocab_size})")
    if mask_id < len(tokenizer) and mask_id not in reserved_token_ids(tokenizer):
        raise PipelineError(f"mask token id {mask_id} ({tokenizer.convert_ids_to_tokens(mask_id)!r}) is an ordinary token "
                            f"of the tokenizer: use a reserved special token or an unused row past its {len(tokenizer)} tokens")
    return mask_id


def suggest_mask_token(tokenizer, facts: TargetFacts) -> str:
    """A hint for the missing-mask-token error: a preset's mask id where this tokenizer reserves it
    (Qwen3.6: 248070, the reference drafters'), else the first reserved special token that the chat
    template never writes, else the first embedding row past the tokenizer's vocabulary."""
    from manifests import load_preset, preset_names
    from pipeline.target import reserved_token_ids

    used = {tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id}
    template = tokenizer.chat_template or ""
    unused = sorted(i for i in reserved_token_ids(tokenizer)
                    if i not in used and tokenizer.convert_ids_to_tokens(i) not in template and i < facts.vocab_size)
    for name in preset_names():
        target = load_preset(name).get("target", {})
        if target.get("vocab_size") == facts.vocab_size and target.get("mask_token") in unused:
            mask_id = target["mask_token"]
            return (f"; e.g. --mask-token {mask_id} ({tokenizer.convert_ids_to_tokens(mask_id)!r}, a reserved token the chat "
                    f"template never writes: the reference drafters' mask id, preset {name})")
    if unused:
        return (f"; e.g. --mask-token {unused[0]} ({tokenizer.convert_ids_to_tokens(unused[0])!r}, a reserved token the "
                "chat template never writes)")
    if len(tokenizer) < facts.vocab_size:
        return f"; e.g. --mask-token {len(tokenizer)} (an embedding row past the tokenizer's {len(tokenizer)} tokens)"
    return ""


def check_mask_absent(reader: CacheReader, mask_id: int) -> None:
    """Refuse a mask id that occurs in the cache's input_ids (the drafter could not tell a masked
    slot from that token). Extract records the reserved ids each shard contains; a shard without
    that record (written before it existed) has its input_ids read."""
    found = []
    for name in reader.shards:
        seen = (reader.manifest.shards[name].counts or {}).get("special_ids")
        if seen is not None:
            hit = mask_id in seen
        else:
            shard = reader.shard(name)
            step = 1 << 24
            hit = any(bool((shard.read_range("input_ids", a, min(a + step, shard.num_tokens)) == mask_id).any())
                      for a in range(0, shard.num_tokens, step))
        if hit:
            found.append(name)
    if found:
        raise PipelineError(f"mask token id {mask_id} occurs in the cache's input_ids ({', '.join(found[:4])}"
                            f"{' and more' if len(found) > 4 else ''}): the drafter could not tell a masked slot from "
                            "that token; choose another mask_token")


def cache_identity(manifest: Manifest) -> dict:
    """What a checkpoint remembers of its cache: a resume on different data is refused."""
    return {"capture": asdict(manifest.identity.capture), "data": asdict(manifest.identity.data),
            "shards": {name: rec.digest for name, rec in sorted(manifest.shards.items())}}


# --------------------------------------------------------------------------- the run


@dataclass
class Plan:
    """Derived sizes of a run."""
    samples_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    per_rank: int
    micro: int


def make_plan(cfg: TrainConfig, samples: int, world: int) -> Plan:
    if cfg.batch_sequences % world:
        raise PipelineError(f"batch_sequences {cfg.batch_sequences} is not divisible by the world size {world}")
    per_rank = cfg.batch_sequences // world
    steps_per_epoch = samples // cfg.batch_sequences
    if steps_per_epoch == 0:
        raise PipelineError(f"the cache has {samples} samples, fewer than one global batch "
                            f"(batch_sequences {cfg.batch_sequences})")
    total = cfg.max_steps or steps_per_epoch * cfg.num_epochs
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_ratio * total)
    return Plan(samples, steps_per_epoch, total, min(warmup, total), per_rank, min(cfg.micro_batch_sequences, per_rank))


def make_optimizer(params: list, cfg: TrainConfig, world: int) -> torch.optim.Optimizer:
    """AdamW; with several ranks its state (8 bytes a parameter: 14 GB for the flagship drafter)
    is sharded across them by torch's ZeroRedundancyOptimizer instead of replicated. Each rank
    steps the parameters it owns and broadcasts them; the update equals plain AdamW's."""
    options = {"lr": cfg.lr, "betas": tuple(cfg.betas), "weight_decay": cfg.weight_decay}
    if world == 1:
        return torch.optim.AdamW(params, **options)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **options)


def describe_optimizer(world: int) -> str:
    return "AdamW" if world == 1 else f"AdamW, state sharded over {world} ranks (torch ZeroRedundancyOptimizer)"


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def open_cache_location(cfg: TrainConfig):
    """The cache's location; a remote one read through bounded local copies with --cache-local."""
    from pipeline.cache.local_copy import LocalCopies
    from pipeline.cache.location import open_location
    from pipeline.config import parse_size

    location = open_location(cfg.cache)
    location.check_reachable()
    if cfg.cache_local is None:
        return location
    if not location.remote:
        raise PipelineError(f"--cache-local: {cfg.cache} is already on this machine's filesystem")
    return LocalCopies(location, Path(cfg.cache_local), parse_size(cfg.cache_local_size))


def run_train(cfg: TrainConfig, *, preset_target: dict | None = None, resume: bool = True, view=None,
              warn=print) -> dict:
    """Train; returns a summary. `view` receives progress (None: silent)."""
    rank, world = init_distributed()
    for name in cfg.report_to:  # a missing extra is one line before anything loads
        tracker_class(name).check_installed()
    hazard = elastic_restart_hazard()
    if hazard and rank == 0 and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        warn(hazard)
    device = pick_device()
    keep_sample_buffers_mapped()  # this process decodes every sample (or forks the loaders that do)
    reader = CacheReader(open_cache_location(cfg))
    manifest = reader.manifest
    target_dir = resolve_target(cfg.target, manifest.recorded_target())
    facts = read_target_facts(target_dir)
    # The weights decide the frozen embedding and lm_head; config.json may be re-saved, so it is not compared.
    check_compatible(manifest, target=str(target_dir), target_claims=identity_claims(target_dir, weights=True, config=False),
                     taps=cfg.target_layer_ids, preset_target=preset_target, preset_name=cfg.preset,
                     allow_mixed_provenance=cfg.allow_mixed_provenance, warn=warn if rank == 0 else (lambda *_: None))
    incomplete = manifest.missing_shards()
    if incomplete["missing"]:
        if not cfg.allow_incomplete_cache:
            raise PipelineError(f"{cfg.cache}: incomplete cache: {describe_missing(incomplete)}; finish the "
                                "extraction, or pass --allow-incomplete-cache to train on what is there")
        if rank == 0:
            warn(f"training on an incomplete cache (--allow-incomplete-cache): {describe_missing(incomplete)}")
    taps = list(manifest.identity.capture.target_layer_ids)
    config = drafter_config(cfg, facts, target_dir, taps)
    check_mask_absent(reader, config.mask_token_id)
    frozen_dtype = autocast_dtype(cfg, device) or torch.float32
    embed, head = frozen_target_modules(target_dir, frozen_dtype)
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(config, embed=embed, lm_head=head).to(device)
    drafter.attention = cfg.attention
    path = attention_path(cfg.attention, device)
    if path == "flex" and device.type != "cuda":
        raise PipelineError(f"attention 'flex' needs a CUDA device (torch has no flex attention backward on {device.type}); "
                            "use 'auto' or 'split'")
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg, world)
    plan = make_plan(cfg, sum(manifest.shards[s].samples for s in reader.shards), world)
    out = Path(cfg.out)
    identity = cache_identity(manifest)

    step, epoch, position, elapsed0, tokens0 = 0, 0, 0, 0.0, 0
    found = list_checkpoints(out)
    if found and not resume:
        raise PipelineError(f"{out}: has checkpoints up to {found[-1].name}; resume (the default) or choose a new --out")
    if found:
        state = read_state(found[-1])
        _check_resumable(found[-1], state, cfg, identity)
        load_checkpoint(found[-1], drafter=drafter, optimizer=optimizer, device=device)
        step, epoch, position = state["step"], state["epoch"], state["position"]
        elapsed0, tokens0 = state.get("elapsed_s", 0.0), state.get("tokens_seen", 0)
    start_step = step
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        _trim_log(out / "train_log.jsonl", step)
        _trim_log(out / "verdicts.jsonl", step)
        write_json_atomic(out / "run.json", {
            "config": asdict(cfg), "target": str(target_dir), "target_config_sha256": facts.config_sha256,
            "target_weights": manifest.identity.target.weights,   # the weights whose predictions the drafter learns
            "cache": reader.location.where() if reader.location.remote else str(Path(cfg.cache).resolve()),
            "world_size": world, "device": str(device), "autocast": str(autocast_dtype(cfg, device)),
            "frozen_dtype": str(frozen_dtype).removeprefix("torch."), "loss_path": LOSS_PATH,
            "attention_path": path,
            "optimizer": describe_optimizer(world),
            "plan": asdict(plan), "drafter": asdict(config), "kernels": list(kernel_paths(manifest)),
            "incomplete_cache": incomplete if incomplete["missing"] else None,
            "resumed_from_step": step})

    trainer = StepRunner(cfg, plan, drafter, optimizer, params, device, rank, world, gamma=cfg.gamma or default_gamma(cfg.block_size))
    model = drafter
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None)
    trainer.model = model

    verdicts = LiveVerdicts(total_steps=plan.total_steps, warmup_steps=plan.warmup_steps, peak_lr=cfg.lr,
                            vocab_size=config.vocab_size, every=cfg.verdict_every)
    fired: list[Verdict] = []
    trackers = Trackers([])
    log_file = None
    if rank == 0:
        for record in _logged(out / "train_log.jsonl"):  # a resumed run: the causes that fired before stay fired
            verdicts.observe(record)
        if cfg.report_to:
            trackers = open_trackers(cfg.report_to, run_dir=out, run_name=out.resolve().name, start_step=step,
                                     params={"config": asdict(cfg), "cache": identity, "plan": asdict(plan),
                                             "drafter": asdict(config), "world_size": world}, warn=warn)
        log_file = open(out / "train_log.jsonl", "a", encoding="utf-8")
    t_start, interval = time.perf_counter(), _Interval()
    last: dict = {}
    if view:
        view.start(total=plan.total_steps, done=step)
    try:
        while step < plan.total_steps:
            stream = SampleStream(reader, seed=cfg.seed, state=StreamState(epoch=epoch, position=position), rank=rank,
                                  world_size=world, prefetch=cfg.prefetch,
                                  fields=SampleStream.FIELDS + (SampleStream.SOFT_FIELDS if cfg.loss == "kl" else ()),
                                  transform=trainer.preparer(epoch), workers=cfg.loader_workers,
                                  mix_shards=cfg.mix_shards)
            items = stream.epoch()
            try:
                while step < plan.total_steps and position + cfg.batch_sequences <= plan.samples_per_epoch:
                    wait0 = time.perf_counter()
                    batch = [next(items)[1] for _ in range(plan.per_rank)]
                    interval.data_wait += time.perf_counter() - wait0
                    logging = (step + 1) % cfg.log_every == 0 or step == 0 or step + 1 == plan.total_steps
                    result = trainer.step(batch, step, with_metrics=logging)
                    step, position = step + 1, position + cfg.batch_sequences
                    interval.tokens += result["tokens"]
                    if logging:
                        last = _log_record(result, trainer, interval, step=step, epoch=epoch, position=position,
                                           plan=plan, elapsed=elapsed0 + time.perf_counter() - t_start)
                        if log_file:
                            log_file.write(json.dumps(last) + "\n")
                            log_file.flush()
                            trackers.log(last)
                            for verdict in verdicts.observe(last):
                                fired.append(verdict)
                                warn(verdict.line())
                                trackers.event(verdict.step, verdict.cause, verdict.message, verdict.figure)
                                _append_json(out / "verdicts.jsonl", asdict(verdict))
                        interval = _Interval()
                    if view:
                        view.update(step, last if logging else None)
                    if step % cfg.checkpoint_every == 0 or step == plan.total_steps:
                        tokens0 += trainer.take_tokens()
                        trackers.flush()  # a resume from this checkpoint finds every line before it in the trackers
                        _checkpoint(out, cfg, drafter, optimizer, step=step, epoch=epoch, position=position,
                                    identity=identity, elapsed=elapsed0 + time.perf_counter() - t_start,
                                    tokens=tokens0, rank=rank, world=world, device=device)
            finally:
                items.close()
            if position + cfg.batch_sequences > plan.samples_per_epoch:
                epoch, position = epoch + 1, 0
        if rank == 0:
            drafter.eval()
            export_drafter(drafter, out / "drafter", dtype=autocast_dtype(cfg, device))
            trackers.artifact(out / "drafter")
    finally:
        if log_file:
            log_file.close()
        trackers.close()
        if view:
            view.stop()
    if not last:
        last = (_logged(out / "train_log.jsonl") or [{}])[-1]
    if world > 1:
        dist.barrier()
    return {"steps": step, "total_steps": plan.total_steps, "epochs": round(step / plan.steps_per_epoch, 3),
            "last": last, "out": str(out), "drafter": str(out / "drafter"), "world_size": world,
            "device": str(device), "autocast": str(autocast_dtype(cfg, device)),
            "wall_s": round(time.perf_counter() - t_start, 2), "resumed": bool(found),
            "verdicts": [v.line() for v in fired], "report_to": cfg.report_to,
            "resumed_from_step": start_step if found else None}


@dataclass
class _Interval:
    tokens: int = 0
    data_wait: float = 0.0
    t0: float = 0.0

    def __post_init__(self):
        self.t0 = time.perf_counter()


def _log_record(result: dict, trainer: StepRunner, interval: _Interval, *, step, epoch, position, plan, elapsed) -> dict:
    seconds = max(time.perf_counter() - interval.t0, 1e-9)
    tokens = float(all_sum(torch.tensor(float(interval.tokens), dtype=torch.float64), trainer.world, trainer.device))
    m = result["metrics"]
    return {
        "step": step, "epoch": epoch, "loss": result["loss"], "accuracy": m["accuracy"], "top4_acc": m["top4_acc"],
        "top8_acc": m["top8_acc"], "avg_streak": m["avg_streak"], "ddtree_streak4": m["ddtree_streak4"],
        "ddtree_streak8": m["ddtree_streak8"], "pos_acc": m["pos_acc"], "lr": result["lr"],
        "grad_norm": result["grad_norm"], "noise_std": result["noise_std"], "tok_per_sec": tokens / seconds,
        "elapsed_s": elapsed,
        # Beyond DESIGN 4: where in the data, and how long this rank waited for it.
        "epoch_progress": epoch + position / plan.samples_per_epoch, "steps_per_epoch": plan.steps_per_epoch,
        "supervised_slots": m["supervised_slots"], "data_wait_frac": interval.data_wait / seconds,
    }


def _checkpoint(out, cfg, drafter, optimizer, *, step, epoch, position, identity, elapsed, tokens, rank, world,
                device):
    # The position is normalised to the start of the next epoch when this one is used up.
    failure = None
    if world > 1:
        optimizer.consolidate_state_dict(to=0)  # a collective: rank 0 then holds the whole state
    if rank == 0:
        try:
            save_checkpoint(out, step=step, drafter=drafter, optimizer=optimizer, keep=cfg.keep_checkpoints,
                            state={"epoch": epoch, "position": position, "elapsed_s": elapsed, "tokens_seen": tokens,
                                   "world_size": world, "config": asdict(cfg), "cache": identity})
        except PipelineError as e:
            failure = e
    # Every rank learns whether rank 0's write failed (a full disk, say), so that all stop with
    # the error instead of the others waiting on a collective that rank 0 never joins.
    if world > 1 and all_sum(torch.tensor([int(failure is not None)]), world, device).item() and failure is None:
        raise PipelineError(f"step {step}: rank 0 could not write the checkpoint (its error says why); "
                            "the last complete checkpoint is kept")
    if failure is not None:
        raise failure


def _check_resumable(path: Path, state: dict, cfg: TrainConfig, identity: dict) -> None:
    saved = state["config"]
    now = asdict(cfg)
    changed = sorted(k for k in now if k not in RESUMABLE_CHANGES and saved.get(k) != now[k])
    if changed:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in changed)
        raise PipelineError(f"{path}: cannot resume, the run's config changed ({detail}); "
                            "use the same options or a new --out")
    if state.get("cache") != identity:
        raise PipelineError(f"{path}: cannot resume, the cache differs from the one this run trained on "
                            "(taps, data or shard digests changed)")


def _logged(path: Path) -> list[dict]:
    """The log's records (a torn last line left out)."""
    records = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def _append_json(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _trim_log(path: Path, step: int) -> None:
    """Keep the log lines up to `step` (the checkpoint resumed from): the resumed run re-logs the rest."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", math.inf) <= step:
                kept.append(line)
        except json.JSONDecodeError:
            break  # a torn last line from a killed run
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    os.replace(tmp, path)
