"""What a cache holds, from its records alone (`pipeline cache-info`): its identity, how complete
it is, which kernels, hosts and environments wrote its shards, its counts and its bytes.

Reads manifest.json, one listing of the cache and each committed shard's commit record
(`shard-NNNNN/digests.json`, where manifest.json's `shard_records` says the per-shard records
are); never an array. On an object store that is one GET for the manifest, one LIST page per
1,000 keys and one GET per shard record (in flight together): the summary says how many requests
it made.
"""

from __future__ import annotations

import time
from collections import Counter

from pipeline.cache.identity import shard_field_name
from pipeline.cache.location import Location
from pipeline.cache.manifest import Manifest, read_manifest
from pipeline.cache.schema import per_shard_files, raw_shard_bytes
from pipeline.errors import PipelineError

# Summed over the committed shards' records (pipeline/data/samples.py writes them per shard).
SUMMED_COUNTS = ("rows", "malformed", "no_supervised_tokens", "overlong_skipped", "truncated", "rows_with_reasoning",
                 "rows_with_tool_calls", "rows_with_tool_replies", "reasoning_turns_dropped",
                 "reasoning_turns_not_rendered", "supervised_tokens", "reasoning_tokens", "tool_call_tokens")
ENVIRONMENT_KEYS = ("torch", "transformers", "flash_linear_attention", "causal_conv1d", "triton", "cuda", "gpu",
                    "tool_version", "git_revision")


def cache_info(location: Location) -> dict:
    """The summary `pipeline cache-info` prints (JSON-ready)."""
    start = time.perf_counter()
    listing = location.listing()
    manifest = read_manifest(location, listing)
    if manifest is None:
        raise PipelineError(f"{location.where()}: no manifest.json (not a cache, or extract has not started yet)")
    names = manifest.committed()
    records = [manifest.shards[n] for n in names]
    return {
        "cache": location.where(),
        "schema_version": manifest.schema_version,
        "created": manifest.created,
        "shard_records": manifest.shard_records or manifest.commit_protocol,  # older caches: the protocol's text
        "identity": _identity(manifest),
        "completeness": _completeness(manifest),
        "provenance": _provenance(manifest, names),
        "counts": _counts(records),
        "bytes": _bytes(manifest, records),
        # Every request this location made (opened for this summary: its reachability check included);
        # None where the backend does not count them (a directory).
        "read": {"requests": location.requests,
                 "records": len(names), "seconds": round(time.perf_counter() - start, 3)},
    }


def _identity(manifest: Manifest) -> dict:
    identity = manifest.identity
    target, tokenizer, capture = identity.target, identity.tokenizer, identity.capture
    weights = target.weights or {}
    return {
        "target": {"model_type": target.model_type, "config_sha256": target.config_sha256,
                   "num_hidden_layers": target.num_hidden_layers, "weights_method": weights.get("method"),
                   "weight_files": len(weights.get("files") or {}), "weight_bytes": weights.get("bytes"),
                   "path_at_extraction": manifest.sources.target},
        "tokenizer": {"files_sha256": tokenizer.files_sha256, "chat_template_sha256": tokenizer.chat_template_sha256,
                      "thinking": tokenizer.thinking, "chat_template_kwargs": tokenizer.chat_template_kwargs,
                      "reasoning": tokenizer.reasoning, "end_of_turn": tokenizer.end_of_turn},
        "capture": {"target_layer_ids": capture.target_layer_ids, "tap_convention": capture.tap_convention,
                    "hidden_size": capture.hidden_size, "vocab_size": capture.vocab_size, "top_k": capture.top_k,
                    "hidden_format": capture.hidden_format, "stored_dtype": capture.stored_dtype,
                    "compute_dtype": capture.compute_dtype, "max_length": capture.max_length,
                    "overlong": capture.overlong,
                    "projection": None if capture.projection is None else {
                        "rank": capture.projection.rank, "digest": capture.projection.digest,
                        "energy": capture.projection.energy, "pilot_tokens": capture.projection.pilot_tokens}},
        "data": {"num_rows": identity.data.num_rows, "files": len(identity.data.files),
                 "generated_by": identity.data.generated_by},
        "num_shards": identity.num_shards,
    }


def _completeness(manifest: Manifest) -> dict:
    missing = manifest.missing_shards()
    foreign = manifest.foreign_shards()
    return {"committed": len(manifest.shards), "planned": manifest.identity.num_shards,
            "complete": not missing["missing"], "missing": missing["missing"], "missing_rows": missing["missing_rows"],
            "broken": dict(manifest.broken),
            "other_identity": {name: [f"{shard_field_name(d.field)}: shard {d.other!r} vs manifest {d.recorded!r}"
                                      for d in diffs] for name, diffs in foreign.items()}}


def _provenance(manifest: Manifest, names: list[str]) -> dict:
    """Shards grouped by what wrote them: the kernel bound for each linear-attention op (and
    whether it was called), the host, the software environment, the parallel layout."""
    ops: dict[str, dict[str, list[str]]] = {}
    paths: dict[str, list[str]] = {}
    hosts: dict[str, list[str]] = {}
    environments: dict[str, list[str]] = {}
    layouts: dict[str, list[str]] = {}
    for name in names:
        record = manifest.shards[name]
        paths.setdefault(record.kernel_path, []).append(name)
        for op, info in sorted(((record.kernels or {}).get("ops") or {}).items()):
            kind = f"{info.get('kind', 'unknown')}{'' if info.get('calls') else ' (bound, not called)'}"
            ops.setdefault(op, {}).setdefault(kind, []).append(name)
        hosts.setdefault(record.host or "unknown", []).append(name)
        env = record.environment or {}
        environments.setdefault(", ".join(f"{k} {env.get(k)}" for k in ENVIRONMENT_KEYS if env.get(k)),
                                []).append(name)
        layout = record.layout or {}
        layouts.setdefault(f"tp {layout.get('tp')} x dp {layout.get('dp')}", []).append(name)
    return {"kernel_path": _grouped(paths), "ops": {op: _grouped(kinds) for op, kinds in ops.items()},
            "hosts": _grouped(hosts), "environments": _grouped(environments), "layouts": _grouped(layouts)}


def _grouped(groups: dict[str, list[str]]) -> dict[str, dict]:
    """{value: {"shards": count, "names": first and last few}} with the largest group first."""
    out = {}
    for value, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        shown = names if len(names) <= 6 else [*names[:3], "...", *names[-2:]]
        out[value] = {"shards": len(names), "names": shown}
    return out


def _counts(records) -> dict:
    sums: Counter = Counter()
    generated_by: Counter = Counter()
    for record in records:
        counts = record.counts or {}
        for key in SUMMED_COUNTS:
            sums[key] += int(counts.get(key) or 0)
        generated_by.update(counts.get("generated_by") or {})
    samples = sum(r.samples for r in records)
    tokens = sum(r.tokens for r in records)
    supervised = sums["supervised_tokens"]
    return {"rows": sums["rows"], "samples": samples, "tokens": tokens, "supervised_tokens": supervised,
            "supervised_share": supervised / tokens if tokens else None,
            "reasoning_share": sums["reasoning_tokens"] / supervised if supervised else None,
            "tool_call_share": sums["tool_call_tokens"] / supervised if supervised else None,
            **{k: sums[k] for k in SUMMED_COUNTS if k not in ("rows", "supervised_tokens")},
            "generated_by": dict(generated_by.most_common())}


def _bytes(manifest: Manifest, records) -> dict:
    capture = manifest.identity.capture
    tokens = sum(r.tokens for r in records)
    stored = sum(r.bytes for r in records)
    # The arrays' bytes before compression, by the schema (what `extract --dry-run` estimates).
    raw = sum(raw_shard_bytes(capture.hidden_format, capture.dims(), samples=r.samples, tokens=r.tokens) for r in records)
    return {"stored": stored, "files": sum(r.files for r in records),
            "per_token": stored / tokens if tokens else None,
            "raw": raw, "raw_per_token": raw / tokens if tokens else None,
            "stored_vs_raw": stored / raw if raw else None,   # pass it to `extract --dry-run --assume-compression`
            "files_per_shard_besides_data": per_shard_files(capture.hidden_format)}
