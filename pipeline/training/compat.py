"""Refuse to train on a cache that does not fit the drafter (DESIGN 6).

Taps, hidden size, vocabulary, layer count and tokenizer must agree between the cache manifest,
the drafter config (preset or file) and the target whose frozen embedding and lm_head are used;
the target's weights must be the ones the cache was extracted with; all shards must come from
the same linear-attention kernels unless the user accepts mixed provenance explicitly.
"""

from __future__ import annotations

from pathlib import Path

from presets import load_preset, preset_names
from pipeline.cache.manifest import Manifest, read_manifest
from pipeline.errors import PipelineError

# Target facts a preset's [target] table may state, as cache identity fields.
PRESET_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size")


def kernel_paths(manifest: Manifest) -> dict[str, list[str]]:
    """{kernel provenance summary: [shards]} over the committed shards."""
    groups: dict[str, list[str]] = {}
    for name, record in sorted(manifest.shards.items()):
        ops = (record.kernels or {}).get("ops") or {}
        summary = record.kernel_path + " (" + ", ".join(
            f"{op}={info.get('kind')}" for op, info in sorted(ops.items()) if info.get("calls")) + ")"
        groups.setdefault(summary, []).append(name)
    return groups


def check_compatible(manifest: Manifest, *, target: str, target_claims: dict, taps: list[int] | None,
                     preset_target: dict | None, preset_name: str | None, allow_mixed_provenance: bool, warn) -> None:
    """Raise PipelineError listing every disagreement; call `warn` for accepted mixed provenance.
    `target_claims`: what the target directory says of the identity (`pipeline.target_model.identity_claims`)."""
    sources = []
    if taps is not None:
        sources.append(("drafter config", {"capture.target_layer_ids": list(taps)}))
    if preset_target:
        sources.append((f"preset {preset_name!r}",
                        {f"capture.{k}": preset_target[k] for k in PRESET_FIELDS if k in preset_target}))
    sources.append((f"target {target}", target_claims))
    problems = []
    for source, claims in sources:
        for d in manifest.identity.differences(claims):
            if d.field == "target.weights.files":
                problems.append(f"target weights: {target} is not the checkpoint the cache was extracted with "
                                "(weight digests differ), so its embedding and lm_head would not match the stored features")
            else:
                problems.append(d.versus("cache", source))
    if problems:
        raise PipelineError("the cache does not fit this drafter: " + "; ".join(problems))
    groups = kernel_paths(manifest)
    unknown = [name for name, record in manifest.shards.items() if record.kernel_path == "unknown"]
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


def match_preset(cache: str | Path) -> str | None:
    """The preset whose [target] (layers, hidden size, vocab) matches the cache's target."""
    manifest = read_manifest(cache)
    if manifest is None:
        return None
    for name in preset_names():
        target = load_preset(name).get("target", {})
        if not manifest.identity.differences({f"capture.{k}": target.get(k) for k in PRESET_FIELDS}):
            return name
    return None
