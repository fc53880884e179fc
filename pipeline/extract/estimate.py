"""What an extraction will write, before it runs (`pipeline extract --dry-run`).

Reads the data and the target's config and tokenizer, never its weights: the validating pass
(every row rendered with the chat template), then each selected shard's rows prepared exactly as
extract prepares them (pipeline/data/samples.py: the same template, masks, length policy and
refusals), so rows, samples and tokens are the ones a real run writes. Bytes come from the
cache schema (pipeline/cache/schema.py: each array's stored dtype and inner shape at these taps,
hidden size, hidden format and top-k), files from the chunking.

What no dry run can know is how well zstd compresses the target's activations: the stored bytes
are the raw bytes times `assume_compression` (stored / raw), 1.0 by default (an upper bound: the
codec never grows a chunk by more than its frame header). Measure the ratio on a pilot shard
(`pipeline cache-info` prints `stored_vs_raw`) and pass it: BENCHMARKS.md "Know the bill" shows
how close that comes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pipeline.extract.extract_record import cache_dims, chunking
from pipeline.cache.schema import array_specs, per_shard_files, raw_shard_bytes, token_bytes
from pipeline.config import ExtractConfig
from pipeline.data.conversations import resolve_data
from pipeline.data.loss_mask import ConversationMasker
from pipeline.data.samples import prepare_samples, scan_dataset
from pipeline.cache.shard_plan import parse_shards, shard_rows
from pipeline.errors import PipelineError
from pipeline.projection.basis import check_projected_rank
from pipeline.target_model import load_tokenizer, read_target_facts, resolve_target
from pipeline.target_model.taps import taps_for, validate_taps


@dataclass
class ExtractionInputs:
    """What extract and its dry run read before any weight: the target's facts and tokenizer, the
    taps, the selected shards and the validated dataset."""
    cfg: ExtractConfig
    target_dir: object
    facts: object
    taps: list[int]
    selected: list[int]
    paths: list
    tokenizer: object
    masker: ConversationMasker
    dataset: dict


def read_inputs(cfg: ExtractConfig, shards_spec: str | None) -> ExtractionInputs:
    """Resolve the target (config and tokenizer only), the taps and the shards, and run the
    validating pass over the data: every refusal a real run makes up front, made here."""
    target_dir = resolve_target(cfg.target)
    facts = read_target_facts(target_dir)
    taps = list(cfg.layers) if cfg.layers is not None else taps_for(cfg.target, facts.num_hidden_layers)
    validate_taps(taps, facts.num_hidden_layers)
    if cfg.top_k > facts.vocab_size:
        raise PipelineError(f"top_k {cfg.top_k} exceeds the target's vocab_size {facts.vocab_size}")
    if cfg.project_taps is not None:
        check_projected_rank(cfg.project_taps, len(taps) * facts.hidden_size)
    selected = parse_shards(shards_spec, cfg.num_shards)
    paths = resolve_data(cfg.data)
    tokenizer = load_tokenizer(target_dir)
    # One masker (one probe of the generation prompt) for the validating pass and every shard.
    masker = ConversationMasker(tokenizer, cfg.end_of_turn, cfg.chat_template_kwargs, cfg.reasoning)
    dataset = scan_dataset(paths, cfg.on_error, masker)
    return ExtractionInputs(cfg, target_dir, facts, taps, selected, paths, tokenizer, masker, dataset)


def estimate_extraction(inputs: ExtractionInputs, *, assume_tokens_per_s: float | None = None,
                        assume_compression: float = 1.0, progress=None) -> dict:
    """The bill of an extraction: rows, tokens, samples per shard, bytes and files, and time at
    an assumed rate. `progress(rows)` after each shard."""
    if not 0 < assume_compression <= 1.5:
        raise PipelineError(f"--assume-compression must be in (0, 1.5] (stored / raw bytes), got {assume_compression}")
    if assume_tokens_per_s is not None and assume_tokens_per_s <= 0:
        raise PipelineError(f"--assume-tokens-per-s must be > 0, got {assume_tokens_per_s}")
    start = time.perf_counter()
    cfg, facts, taps = inputs.cfg, inputs.facts, inputs.taps
    dims = cache_dims(cfg, facts, taps)
    layout = chunking(cfg)
    per_token = {s.name: token_bytes(s, dims) for s in array_specs(cfg.hidden_format) if s.per == "token"}
    num_rows = inputs.dataset["num_rows"]
    shards, totals = [], {"rows": 0, "samples": 0, "tokens": 0, "supervised_tokens": 0, "truncated": 0,
                          "overlong_skipped": 0, "no_supervised_tokens": 0, "malformed": 0, "reasoning_tokens": 0,
                          "tool_call_tokens": 0, "raw_bytes": 0, "files": 0}
    empty = []
    for shard in inputs.selected:
        rows = shard_rows(shard, num_rows, cfg.num_shards)
        samples, counts = prepare_samples(cfg, inputs.paths, rows, inputs.masker, facts.vocab_size,
                                          inputs.dataset["index"])
        tokens = sum(len(ids) for _, ids, _ in samples)
        raw = raw_shard_bytes(cfg.hidden_format, dims, samples=len(samples), tokens=tokens)
        files = (layout.files(cfg.hidden_format, dims, tokens) + per_shard_files(cfg.hidden_format)) if samples else 0
        if not samples:
            empty.append(shard)
        shards.append({"shard": shard, "rows": len(rows), "samples": len(samples), "tokens": tokens, "raw_bytes": raw,
                       "files": files})
        for key in ("truncated", "overlong_skipped", "no_supervised_tokens", "malformed", "supervised_tokens",
                    "reasoning_tokens", "tool_call_tokens"):
            totals[key] += counts[key]
        totals["rows"] += len(rows)
        totals["samples"] += len(samples)
        totals["tokens"] += tokens
        totals["raw_bytes"] += raw
        totals["files"] += files
        if progress:
            progress(len(rows))
    tokens = totals["tokens"]
    raw_per_token = sum(per_token.values())
    # A projected cache first runs its pilot through the target (taps only) unless the cache has
    # its basis already; the forward tokens below count it.
    pilot = None if cfg.project_taps is None else \
        min(cfg.pilot_tokens, tokens) if len(inputs.selected) == cfg.num_shards else cfg.pilot_tokens
    samples_per_shard = [s["samples"] for s in shards]
    return {
        "dry_run": True,
        "target": str(inputs.target_dir),
        "taps": taps, "hidden_size": facts.hidden_size, "vocab_size": facts.vocab_size, "top_k": cfg.top_k,
        "hidden_format": cfg.hidden_format,
        "dataset_rows": num_rows, "dataset_malformed_rows": inputs.dataset["malformed_rows"],
        "selected_shards": len(inputs.selected), "num_shards": cfg.num_shards,
        **totals,
        "valid_rows": totals["samples"], "refused_rows": totals["rows"] - totals["samples"],
        "supervised_share": totals["supervised_tokens"] / tokens if tokens else None,
        "samples_per_shard": {"min": min(samples_per_shard, default=0), "max": max(samples_per_shard, default=0),
                              "mean": sum(samples_per_shard) / len(samples_per_shard) if shards else 0},
        "empty_shards": empty,
        "raw_bytes_per_token": raw_per_token,
        "raw_bytes_per_token_by_array": per_token,
        "assume_compression": assume_compression,
        "stored_bytes": int(totals["raw_bytes"] * assume_compression),
        "stored_bytes_per_token": raw_per_token * assume_compression,
        "files_per_shard": {"min": min((s["files"] for s in shards), default=0),
                            "max": max((s["files"] for s in shards), default=0)},
        "assume_tokens_per_s": assume_tokens_per_s,
        "projected_rank": cfg.project_taps,
        "full_taps_raw_bytes_per_token": len(taps) * facts.hidden_size * 2,
        "pilot_tokens": pilot,
        "forward_tokens": tokens + (pilot or 0),
        "extract_seconds": (tokens + (pilot or 0)) / assume_tokens_per_s if assume_tokens_per_s else None,
        "dry_run_seconds": time.perf_counter() - start,
        "shards": shards,
    }
