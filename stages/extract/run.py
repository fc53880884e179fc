"""Stage one, `pipeline extract`: run the target once and write the hidden-state cache.

The cache is a directory or an object-store prefix (pipeline/cache/location.py). The manifest is
created once (if absent; a later invocation must match its identity). Per selected shard: skip
it if its commit record is there, take its lock in a directory (skip it if another process
holds it), else read and tokenize its rows, run the target over length-sorted batches, hand the
results to a background writer (compression + storage off the forward path), and commit the
shard by writing its record last (DESIGN 11: no rename, no lock needed for correctness). Cost: one target forward per token,
plus the logits top-k/logsumexp in token chunks.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace

from pipeline.extract.claim import claim_shard, refuse_foreign_content
from pipeline.extract.estimate import estimate_extraction, read_inputs
from pipeline.extract.extract_record import cache_dims, chunking, identity_record
from pipeline.cache.address import open_location
from pipeline.cache.location import LocalLocation
from pipeline.cache.manifest import SourcesRecord, create_manifest, new_manifest, read_manifest
from pipeline.cache.schema import MANIFEST
from pipeline.cache.store_probe import check_create_if_absent
from pipeline.extract.pilot_run import projection_basis
from pipeline.extract.shard_run import ShardRun
from pipeline.config import ExtractConfig
from pipeline.cache.shard_plan import assign_to_groups, shard_rows
from pipeline.devices import dtype_name, resolve_device
from pipeline.distributed import init_layout
from pipeline.errors import PipelineError
from pipeline.provenance import environment
from pipeline.target_model import load_target_on_layout
from pipeline.target_model.capture import Capture
from pipeline.ui import ProgressBar


def _with_source(cfg: ExtractConfig) -> ExtractConfig:
    if cfg.generated_by is None and all(d.startswith("embedded:") for d in cfg.data):
        return replace(cfg, generated_by="the embedded target itself, greedy (pipeline/toy/generate.py)")
    return cfg


def refuse_other_projection(location, cfg: ExtractConfig) -> None:
    """A cache's taps are stored whole or projected to one R, for good: another --project-taps on
    an existing cache is one line (the full identity comparison follows once the target loads)."""
    manifest = read_manifest(location)
    if manifest is None:
        return
    projected_rank = manifest.identity.capture.projected_rank
    if projected_rank != cfg.project_taps:
        stored = f"projected to {projected_rank} values a token" if projected_rank else "whole (not projected)"
        asked = f"--project-taps {cfg.project_taps}" if cfg.project_taps else "no --project-taps"
        raise PipelineError(f"{location.where()}: stores the taps {stored}, this extract has {asked}: use the "
                            "cache's setting or another --cache")


def run_extract_dry(cfg: ExtractConfig, shards_spec: str | None, *, assume_tokens_per_s: float | None = None,
                    assume_compression: float = 1.0, progress: bool = True) -> dict:
    """`extract --dry-run`: the bill of this extraction (pipeline/extract/estimate.py). Reads the
    data, the target's config and tokenizer; loads no weights and writes nothing."""
    inputs = read_inputs(_with_source(cfg), shards_spec)
    num_rows = inputs.dataset["num_rows"]
    bar = ProgressBar("dry run", "rows", enabled=progress,
                      total=sum(len(shard_rows(s, num_rows, cfg.num_shards)) for s in inputs.selected))
    with bar:
        summary = estimate_extraction(inputs, assume_tokens_per_s=assume_tokens_per_s,
                                      assume_compression=assume_compression, progress=bar.advance)
    return {"cache": cfg.cache, **summary}


def run_extract(cfg: ExtractConfig, shards_spec: str | None, *, progress: bool = True) -> dict:
    start = time.perf_counter()
    layout = init_layout(cfg.tp)
    location = open_location(cfg.cache)
    probe = None
    if layout.is_writer:  # a bad location fails here, before any data is read or a model loaded
        location.ensure_root()
        refuse_foreign_content(location, projected=cfg.project_taps is not None)
        probe = check_create_if_absent(location)  # the commit protocol's one primitive, or no cache
    inputs = read_inputs(_with_source(cfg), shards_spec)
    cfg, target_dir, facts, taps, selected = inputs.cfg, inputs.target_dir, inputs.facts, inputs.taps, inputs.selected
    paths, tokenizer, masker, dataset = inputs.paths, inputs.tokenizer, inputs.masker, inputs.dataset

    refuse_other_projection(location, cfg)  # before the weights load and a pilot runs for nothing
    device, dtype = resolve_device("auto", cfg.compute_dtype)
    compute = dtype_name(dtype)
    model, tp_plan = load_target_on_layout(target_dir, dtype, device, layout, facts.num_key_value_heads)
    basis = projection = pilot = None
    if cfg.project_taps is not None:  # the basis, fitted on a pilot or read from the cache, before the manifest
        with ProgressBar("pilot", "tokens", enabled=progress and layout.rank == 0,
                         total=cfg.pilot_tokens) as pilot_bar:
            basis, projection, pilot = projection_basis(cfg, location=location, layout=layout, model=model, taps=taps,
                                                        inputs=inputs, progress=lambda n: pilot_bar.advance(n))
    identity = identity_record(cfg, facts=facts, tokenizer=tokenizer, prompt=masker.prompt(cfg.chat_template_kwargs),
                               target_dir=target_dir, taps=taps,
                               dataset=dataset, compute_dtype=compute, projection=projection)
    plan = {"assignment": "contiguous: shard s holds rows [s*N//S, (s+1)*N//S)", "num_rows": dataset["num_rows"],
            "num_shards": cfg.num_shards,
            "storage": chunking(cfg).geometry(cfg.hidden_format, cache_dims(cfg, facts, taps))}
    if layout.is_writer:
        manifest, created = create_manifest(location, new_manifest(
            identity=identity, provenance=environment(), plan=plan, resolved_config=asdict(cfg),
            sources=SourcesRecord(target=str(target_dir), data=[str(p) for p in paths])))
        # `manifest` is what the store holds now, read back even when this call created it.
        conflicts = [d.arrow() for d in manifest.identity.differences(identity.flat(), complete=True)]
        if conflicts:
            shown = "; ".join(conflicts[:4]) + (f"; and {len(conflicts) - 4} more" if len(conflicts) > 4 else "")
            if created:
                raise PipelineError(f"{location.where(MANIFEST)}: another extract replaced the manifest this one had "
                                    f"just created ({shown}), so the store let two writers create it; nothing was "
                                    "written by this run; use a store that honours create-if-absent writes")
            raise PipelineError(f"{location.where()}: was created with a different configuration ({shown}); "
                                "use another --cache or the original settings")
    mine = assign_to_groups(selected, layout.dp, layout.dp_rank)
    run = ShardRun(cfg=cfg, paths=paths, masker=masker, facts=facts, taps=taps, model=model, layout=layout,
                   location=location, tp_plan=tp_plan, identity=identity, index=dataset["index"],
                   capture=Capture(model, taps, top_k=cfg.top_k, pad_id=tokenizer.pad_token_id or 0,
                                   project=None if basis is None else basis.to(next(model.parameters()).device).project_taps))
    skipped = {"committed": 0, "locked": 0}
    locks = cfg.shard_locks and isinstance(location, LocalLocation)
    bar = ProgressBar("extract", "samples", enabled=progress and layout.rank == 0,
                      total=sum(len(shard_rows(s, dataset["num_rows"], cfg.num_shards)) for s in mine))
    stream_start = time.perf_counter()
    with bar:
        try:
            for shard in mine:
                rows = shard_rows(shard, dataset["num_rows"], cfg.num_shards)
                state, lock = claim_shard(location, shard, layout, locks)
                if state != "write":
                    skipped[state] += 1
                    bar.advance(len(rows))
                    continue
                run.process(shard, rows, lock, bar)
        finally:
            run.close()
    stream_seconds = time.perf_counter() - stream_start
    seconds = time.perf_counter() - start
    written = run.totals()
    totals = {"shards_written": written.pop("shards_written"),
              "shards_already_committed": skipped["committed"] + run.committed_elsewhere,
              "shards_locked_elsewhere": skipped["locked"], **written}
    raw_hidden = len(taps) * facts.hidden_size * 2
    tokens = max(totals["tokens"], 1)
    return {
        "cache": location.where(),
        "rank": layout.rank,
        "layout": layout.record(),
        "selected_shards": len(selected),
        "my_shards": len(mine),
        **totals,
        "bytes_per_token": totals["stored_bytes"] / tokens if totals["tokens"] else None,
        "raw_bf16_hidden_bytes_per_token": raw_hidden,
        "compression_vs_raw_bf16_hidden": raw_hidden * tokens / totals["stored_bytes"] if totals["stored_bytes"] else None,
        "seconds": seconds,
        "setup_seconds": seconds - stream_seconds,
        "tokens_per_s": totals["tokens"] / seconds,
        "stream_tokens_per_s": totals["tokens"] / stream_seconds,
        "writer": "inline" if run.writer_queue == 0 else f"background thread, queue {run.writer_queue}",
        "store_probe": probe.record() if probe is not None else None,
        "projection": None if pilot is None else {"rank": cfg.project_taps, **pilot},
    }
