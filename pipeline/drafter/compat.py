"""Refuse to train on a cache that does not fit the drafter (DESIGN 6).

Taps, hidden size, vocabulary, layer count and tokenizer must agree between the cache manifest,
the drafter config (preset or file) and the target whose frozen embedding and lm_head are used;
the target's weights must be the ones the cache was extracted with; all shards must come from
the same linear-attention kernels unless the user accepts mixed provenance explicitly.
"""

from __future__ import annotations

from pipeline.errors import PipelineError
from pipeline.target import TargetFacts


def kernel_paths(manifest: dict) -> dict[str, list[str]]:
    """{kernel provenance summary: [shards]} over the committed shards."""
    groups: dict[str, list[str]] = {}
    for name, record in sorted(manifest["shards"].items()):
        kernels = record.get("kernels") or {}
        ops = kernels.get("ops") or {}
        summary = kernels.get("path", "unrecorded") + " (" + ", ".join(
            f"{op}={info.get('kind')}" for op, info in sorted(ops.items()) if info.get("calls")) + ")"
        groups.setdefault(summary, []).append(name)
    return groups


def check_compatible(manifest: dict, *, facts: TargetFacts, tokenizer_sha256: str, weights: dict | None,
                     taps: list[int] | None, preset_target: dict | None, preset_name: str | None,
                     allow_mixed_provenance: bool, warn) -> None:
    """Raise PipelineError listing every disagreement; call `warn` for accepted mixed provenance."""
    capture = manifest["config"]["capture"]
    recorded = manifest["config"]
    problems = []

    def differ(what, cache_value, other_value, other_name):
        if cache_value != other_value:
            problems.append(f"{what}: cache {cache_value} vs {other_name} {other_value}")

    if taps is not None:
        differ("target_layer_ids", capture["target_layer_ids"], list(taps), "drafter config")
    if preset_target:
        source = f"preset {preset_name!r}"
        for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
            if key in preset_target:
                differ(key, capture[key], preset_target[key], source)
    differ("hidden_size", capture["hidden_size"], facts.hidden_size, f"target {facts.path}")
    differ("vocab_size", capture["vocab_size"], facts.vocab_size, f"target {facts.path}")
    differ("num_hidden_layers", capture["num_hidden_layers"], facts.num_hidden_layers, f"target {facts.path}")
    differ("tokenizer files sha256", recorded["tokenizer"]["files_sha256"], tokenizer_sha256, f"target {facts.path}")
    if weights is not None and recorded["target"].get("weights", {}).get("files") != weights.get("files"):
        problems.append(f"target weights: {facts.path} is not the checkpoint the cache was extracted with "
                        "(weight digests differ), so its embedding and lm_head would not match the stored features")
    if problems:
        raise PipelineError("the cache does not fit this drafter: " + "; ".join(problems))
    groups = kernel_paths(manifest)
    unknown = [name for name, record in manifest["shards"].items() if (record.get("kernels") or {}).get("path") == "unknown"]
    if unknown:
        if not allow_mixed_provenance:
            raise PipelineError(f"kernel provenance unknown for {len(unknown)} shards (e.g. {unknown[0]}): the "
                                "linear-attention implementation could not be identified at extraction. Re-extract with "
                                "a transformers version this tool reads, or pass --allow-mixed-provenance to train anyway")
        warn(f"training on shards of unknown kernel provenance (--allow-mixed-provenance): {len(unknown)} shards")
    if len(groups) > 1:
        detail = "; ".join(f"{k}: {len(v)} shards (e.g. {v[0]})" for k, v in groups.items())
        if not allow_mixed_provenance:
            raise PipelineError(f"mixed kernel provenance across shards ({detail}); features from different "
                                "linear-attention kernels differ numerically. Re-extract, or pass "
                                "--allow-mixed-provenance to train anyway")
        warn(f"training on mixed kernel provenance (--allow-mixed-provenance): {detail}")
