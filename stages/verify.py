"""`pipeline verify-cache`: prove a cache is complete, intact, aligned and correctly masked.

Orchestrates the checks, over every sample of the selected shards (DESIGN 10): model-free ones
(pipeline/cache/checks.py: structure, digests, checksums, finiteness, tap signatures, label
alignment, top-k, provenance), the loss masks with the target's tokenizer and chat template
(pipeline/cache/sample_checks.py), and, with the target's weights, the tail recompute of every
sample and the stratified `--recompute N` (pipeline/cache/model_checks.py), on a GPU when present.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import numpy as np

from pipeline.cache.checks import (
    Check,
    check_alignment,
    check_chunks,
    check_digests,
    check_provenance,
    check_structure,
    open_cache,
    sound_shards,
)
from pipeline.cache.location import open_location
from pipeline.cache.manifest import describe_missing
from pipeline.cache.model_checks import check_recompute, check_tail, stratified_picks
from pipeline.cache.reader import CacheReader
from pipeline.cache.sample_checks import check_loss_masks, check_mask_boundaries
from pipeline.cache.schema import shard_index, shard_name
from pipeline.data.loss_mask import token_kinds
from pipeline.data.shard_plan import parse_shards
from pipeline.devices import resolve_device
from pipeline.errors import PipelineError
from pipeline.target import identity_claims, load_model, load_tokenizer, resolve_target
from pipeline.ui import ProgressBar


def select_shards(reader: CacheReader, spec: str | None, *, broken: bool = False) -> list[str]:
    """Committed shards (`broken`: also those whose commit record does not match their files,
    for the structure and digest checks to name what is wrong with them)."""
    names = sorted({*reader.shards, *(reader.manifest.broken if broken else ())}, key=shard_index)
    if spec is None:
        return names
    wanted = {shard_name(i) for i in parse_shards(spec, reader.manifest.identity.num_shards)}
    return [s for s in names if s in wanted]


def check_completeness(reader: CacheReader, spec: str | None) -> Check:
    """Every one of the cache's num_shards (or of --shards) is committed."""
    wanted = None if spec is None else parse_shards(spec, reader.manifest.identity.num_shards)
    found = reader.manifest.missing_shards(wanted)
    if not found["missing"]:
        return Check("completeness", True, f"all {found['checked']} shards committed", found)
    return Check("completeness", False, describe_missing(found) + "; extract the missing shards (same command)", found)


def check_target_identity(reader: CacheReader, target_dir: Path, tokenizer) -> Check:
    """The target is the one the cache was extracted with: config, tokenizer, chat template, sizes."""
    differences = reader.manifest.identity.differences(identity_claims(target_dir, tokenizer=tokenizer))
    problems = [d.versus("cache", "target") for d in differences]
    return Check("target_identity", not problems, f"{target_dir}: " + ("; ".join(problems) if problems else "config, tokenizer and chat template match the manifest"),
                 {"problems": problems, "fields": [d.field for d in differences]})


def run_verify(cache_dir: str | Path, *, shards: str | None = None, target: Path | None = None, recompute: int = 0,
               tail_rate: float = 1.0, sample_rate: float = 1.0, seed: int = 0, device: str = "auto",
               dtype: str = "auto", progress: bool = False) -> dict:
    start = time.perf_counter()
    if not 0.0 < sample_rate <= 1.0:
        raise PipelineError(f"--sample-rate must be in (0, 1], got {sample_rate}")
    if not 0.0 <= tail_rate <= 1.0:
        raise PipelineError(f"--tail-rate must be in [0, 1], got {tail_rate}")
    if recompute < 0:
        raise PipelineError(f"--recompute must be >= 0, got {recompute}")
    placement = resolve_device(device, dtype)
    location = open_location(cache_dir)
    location.check_reachable()  # no such directory, a missing bucket, refused credentials: one line
    try:
        reader = CacheReader(location)
    except PipelineError as e:
        return {"cache": location.where(), "passed": False, "checks": [Check("manifest", False, str(e)).record()]}
    selected = select_shards(reader, shards)
    checks = [Check("manifest", True, f"schema {reader.manifest.schema_version}, {len(reader.shards)} committed shards, "
                                      f"{len(selected)} selected")]
    checks.append(check_completeness(reader, shards))
    with_broken = select_shards(reader, shards, broken=True)
    checks.append(check_structure(reader, with_broken))
    checks.append(check_digests(reader, with_broken, sample_rate >= 1.0))
    with ProgressBar("verify chunks", "shards", total=len(selected), enabled=progress) as bar:
        checks.extend(check_chunks(reader, selected, sample_rate, seed, lambda: bar.advance(1)))
    checks.extend(check_alignment(reader, selected))
    checks.append(check_provenance(reader, selected))
    target_dir, no_target = None, None
    try:
        target_dir = resolve_target(target, reader.manifest.recorded_target())
    except PipelineError as e:
        if recompute or target is not None:
            raise PipelineError(f"--recompute needs the target: {e}" if target is None else str(e)) from None
        no_target = str(e)
    # Content checks read samples; a shard whose declared shapes disagree with the manifest is
    # reported by the structure check above and not read further.
    present = [name for name, _ in sound_shards(reader, selected)]
    compute = None
    if target_dir is not None and present:
        tokenizer = load_tokenizer(target_dir)
        checks.append(check_target_identity(reader, target_dir, tokenizer))
        checks.append(check_mask_boundaries(reader, present, tokenizer))
        checks.append(check_loss_masks(reader, present, tokenizer))
        if tail_rate > 0 or recompute:
            model = load_model(target_dir, dtype=placement[1]).to(placement[0])
            compute = {"device": str(placement[0]), "dtype": str(placement[1]).removeprefix("torch.")}
            if tail_rate > 0:
                checks.append(check_tail(reader, present, model, tail_rate, seed, compute["dtype"]))
            if recompute:
                tol = 0.02 if reader.hidden_format == "bf16" else 0.1
                if compute["dtype"] == "bfloat16":
                    tol *= 4  # the recompute itself rounds to bf16 (not yet measured on a GPU)
                checks.append(check_recompute(reader, stratified_picks(reader, present, recompute, seed + 1), model, tol))
    else:
        reason = (f"no target to take the tokenizer and chat template from ({no_target})" if no_target
                  else "no readable shard among those selected")
        checks.append(Check("loss_mask", True, f"skipped: {reason}", skipped=True))
    seconds = time.perf_counter() - start
    tokens = sum(reader.manifest.shards[s].tokens for s in selected)
    return {"cache": location.where(), "passed": all(c.passed for c in checks), "checks": [c.record() for c in checks],
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "compute": compute,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def show_sample(cache_dir: str | Path, sample_id: int, target: Path | None) -> dict:
    """The sample as `--show` prints it: its tokens decoded one by one, each one's kind
    (reasoning, content, tool call, end of turn; '' = not supervised), loss mask and label (the
    target's argmax at the position before, DESIGN 3.2), and a one-line span summary."""
    reader = open_cache(cache_dir)
    shard = reader.find(sample_id)
    try:
        target_dir = resolve_target(target, reader.manifest.recorded_target())
    except PipelineError as e:
        raise PipelineError(f"--show needs the target's tokenizer: {e}") from None
    tokenizer = load_tokenizer(target_dir)
    ids, mask = shard.read("input_ids", sample_id).tolist(), shard.read("loss_mask", sample_id).tolist()
    argmax = shard.read("target_argmax", sample_id).tolist()
    pieces = [tokenizer.decode([token]) for token in ids]
    ends = np.cumsum([len(p) for p in pieces])
    offsets = np.stack([ends - [len(p) for p in pieces], ends], axis=1) if pieces else np.zeros((0, 2), dtype=np.int64)
    kinds = token_kinds("".join(pieces), offsets, mask, reader.manifest.identity.tokenizer.end_of_turn)
    supervised = [i for i, m in enumerate(mask) if m]
    by_kind = ", ".join(f"{kinds.count(k)} {k.replace('_', ' ')}" for k in ("reasoning", "content", "tool_call", "end_of_turn"))
    header = (f"sample {sample_id} ({shard.name}): {len(ids)} tokens, {len(supervised)} supervised ({by_kind}), "
              f"first {supervised[0] if supervised else None}, last {supervised[-1] if supervised else None}")
    return {"sample_id": sample_id, "shard": shard.name, "summary": header, "input_ids": ids, "loss_mask": mask,
            "labels": [None, *argmax[:-1]], "pieces": pieces, "kinds": kinds}
