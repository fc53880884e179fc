"""`pipeline verify-cache`: prove a cache is complete, intact, aligned and correctly masked.

Orchestrates the checks, over every sample of the selected shards (DESIGN 10): model-free ones
(pipeline/cache/: selection_checks (completeness, target identity), structure_checks (structure,
digests, a projected cache's basis, provenance), chunk_checks (checksums, finiteness, tap
signatures), label_checks (label alignment, top-k)), the loss masks with the target's tokenizer and chat template
(pipeline/verify/sample_checks.py), and, with the target's weights, the tail recompute of every
sample and the stratified `--recompute N` (pipeline/verify/model_checks.py), on a GPU when present.
"""

from __future__ import annotations

import resource
import time

from pipeline.verify.bounded_reads import sound_shards
from pipeline.verify.check_report import Check
from pipeline.verify.chunk_checks import check_chunks
from pipeline.verify.label_checks import check_alignment
from pipeline.cache.address import open_location
from pipeline.verify.tap_alignment import PROJECTED_TOLERANCE
from pipeline.verify.model_checks import (check_recompute, check_tail, stratified_picks,
                                          tail_unavailable)
from pipeline.cache.reader import CacheReader
from pipeline.verify.sample_checks import check_loss_masks, check_mask_boundaries
from pipeline.verify.selection_checks import check_completeness, check_target_identity, select_shards
from pipeline.verify.structure_checks import check_basis, check_digests, check_provenance, check_structure
from pipeline.devices import dtype_name, resolve_device
from pipeline.errors import PipelineError
from pipeline.records.verify_result import VerifyResult
from pipeline.target_model import load_target, load_tokenizer, recorded_in_cache, resolve_target
from pipeline.ui import ProgressBar
from stages.verify_cache.options import VerifyOptions


def run_verify(options: VerifyOptions, *, progress: bool = False) -> dict:
    """Every check of the cache, in order; the checks that need the target run where it is known."""
    o = options
    shards, target, recompute, tail_rate, sample_rate, seed = o.shards, o.target, o.recompute, o.tail_rate, o.sample_rate, o.seed
    start = time.perf_counter()
    if not 0.0 < sample_rate <= 1.0:
        raise PipelineError(f"--sample-rate must be in (0, 1], got {sample_rate}")
    if not 0.0 <= tail_rate <= 1.0:
        raise PipelineError(f"--tail-rate must be in [0, 1], got {tail_rate}")
    if recompute < 0:
        raise PipelineError(f"--recompute must be >= 0, got {recompute}")
    placement = resolve_device(o.device, o.dtype)
    location = open_location(o.cache)
    location.check_reachable()  # no such directory, a missing bucket, refused credentials: one line
    try:
        reader = CacheReader(location, foreign="report")  # shards of another identity: named by check_provenance
    except PipelineError as e:
        return VerifyResult(location.where(), False, [Check("manifest", False, str(e)).line()]).to_json()
    selected = select_shards(reader, shards)
    checks = [Check("manifest", True, f"schema {reader.manifest.schema_version}, {len(reader.shards)} committed shards, "
                                      f"{len(selected)} selected")]
    checks.append(check_completeness(reader, shards))
    with_broken = select_shards(reader, shards, broken=True)
    checks.append(check_structure(reader, with_broken))
    checks.append(check_digests(reader, with_broken, sample_rate >= 1.0))
    if reader.manifest.identity.capture.projection is not None:
        checks.append(check_basis(reader))
    with ProgressBar("verify chunks", "shards", total=len(selected), enabled=progress) as bar:
        checks.extend(check_chunks(reader, selected, sample_rate, seed, lambda: bar.advance(1)))
    checks.extend(check_alignment(reader, selected))
    checks.append(check_provenance(reader, selected))
    target_dir, no_target = None, None
    try:
        target_dir = resolve_target(target, recorded_in_cache(reader.manifest))
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
        # A projected cache has no tap to run the tail from: the check's line says so, and the
        # target is loaded only if --recompute needs it.
        no_tail = tail_unavailable(reader.manifest.identity.capture) if tail_rate > 0 else None
        if no_tail:
            checks.append(Check("tail_recompute", True, f"skipped: {no_tail}", skipped=True))
        tail = tail_rate > 0 and not no_tail
        if tail or recompute:
            model = load_target(target_dir, dtype=placement[1]).to(placement[0])
            compute = {"device": str(placement[0]), "dtype": dtype_name(placement[1])}
            if tail:
                checks.append(check_tail(reader, present, model, tail_rate, seed, compute["dtype"]))
            if recompute:
                if reader.manifest.identity.capture.projection is not None:
                    tol = PROJECTED_TOLERANCE[reader.hidden_format]  # measured with bf16 compute on either side
                else:
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
    return VerifyResult(location.where(), all(c.passed for c in checks), [c.line() for c in checks], tokens=tokens,
                        seconds=seconds, tokens_per_s=tokens / seconds, compute=compute,
                        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024).to_json()
