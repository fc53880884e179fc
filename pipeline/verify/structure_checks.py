"""Model-free checks that a cache's shards are what its manifest says (DESIGN 5, 6): every
listed shard present with the declared counts, offsets, dtypes, shapes and chunking; every file's
sha256 as its shard's commit record lists it; provenance agreeing across shards; a projected
cache's basis the one its manifest names.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from pipeline.verify.check_report import Check
from pipeline.cache.commit import hash_shard, read_digests
from pipeline.files import digest_of_files
from pipeline.cache.identity import shard_field_name
from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import BASIS, DIGESTS, array_specs
from pipeline.errors import PipelineError
from pipeline.projection.basis_file import cache_basis


def check_structure(reader: CacheReader, shards: list[str]) -> Check:
    """Every listed shard exists; counts, offsets, dtypes, shapes and chunking are as declared."""
    problems, specs = [], array_specs(reader.hidden_format)
    dims = reader.manifest.identity.capture.dims()
    storage = {spec.name: (reader.chunking.chunk_tokens(spec, dims), reader.chunking.file_tokens(spec, dims))
               for spec in specs}
    for name in shards:
        if name in reader.manifest.broken:  # a record that does not match its files: not committed
            problems.append(reader.manifest.broken[name])
            continue
        record = reader.manifest.shards[name]
        if not reader.present(name):
            problems.append(f"{name}: listed in the manifest but missing on disk")
            continue
        try:
            # Declared shapes are checked against the manifest before anything is read.
            shard = reader.shard(name)
        except PipelineError as e:
            problems.append(str(e))
            continue
        if shard.num_samples != record.samples or shard.num_tokens != record.tokens:
            problems.append(f"{name}: {shard.num_samples} samples / {shard.num_tokens} tokens on disk, "
                            f"manifest says {record.samples} / {record.tokens}")
        if shard.offsets[0] != 0 or np.any(np.diff(shard.offsets) <= 0):
            problems.append(f"{name}: offsets are not strictly increasing from 0")
        if len(set(shard.sample_ids.tolist())) != shard.num_samples:
            problems.append(f"{name}: repeated sample ids")
        for spec in specs:
            if spec.name not in shard.group:
                problems.append(f"{name}/{spec.name}: array missing")
                continue
            arr = shard.group[spec.name]
            want = spec.shape(dims, samples=shard.num_samples, tokens=shard.num_tokens)
            if tuple(arr.shape) != want or str(arr.dtype) != spec.dtype:
                problems.append(f"{name}/{spec.name}: {arr.dtype}{tuple(arr.shape)}, declared {spec.dtype}{want}")
            elif spec.per == "token" and (arr.chunks[0], arr.shards and arr.shards[0]) != storage.get(spec.name):
                problems.append(f"{name}/{spec.name}: {arr.chunks[0]}-token chunks in {arr.shards}-token files, the "
                                f"manifest's chunking gives {storage.get(spec.name)}")
        attrs = dict(shard.group.attrs)
        for key in ("samples", "tokens", "row_range", "kernels", "identity"):
            if attrs.get(key) != getattr(record, key):
                problems.append(f"{name}: shard attribute {key!r} disagrees with the manifest")
    return Check("structure", not problems,
                 f"{len(shards)} shards: counts, offsets, dtypes, shapes, chunking" + (f"; {len(problems)} problems" if problems else " as declared"),
                 {"problems": problems[:50]})


def check_digests(reader: CacheReader, shards: list[str], enabled: bool) -> Check:
    """Re-hash every file where it lives (streamed; no local copy of a remote cache): each against
    the shard's digests.json (so a mismatch is named by file), and the shard's digest derived from
    them against its record."""
    if not enabled:
        return Check("digests", True, "skipped: --sample-rate < 1 reads only part of the cache", skipped=True)
    bad, files_checked = [], 0
    for name in shards:
        if not reader.present(name):
            continue  # reported by check_structure
        try:
            on_disk = hash_shard(reader.location, name, reader.files(name))
            listed = read_digests(reader.location, name)
        except PipelineError as e:
            bad.append(f"{name} ({e})")
            continue
        files_checked += len(on_disk)
        for rel in sorted(set(on_disk) | set(listed)):
            if rel not in listed:
                bad.append(f"{name}/{rel}: not listed in {DIGESTS}")
            elif rel not in on_disk:
                bad.append(f"{name}/{rel}: listed in {DIGESTS} but missing")
            elif on_disk[rel] != listed[rel]:
                bad.append(f"{name}/{rel}: sha256 or size differs from {DIGESTS}")
        record = reader.manifest.shards.get(name)
        if record is not None and "sha256:" + digest_of_files(on_disk) != record.digest:
            bad.append(f"{name}: digest of its files differs from its commit record")
    return Check("digests", not bad, f"sha256 of {files_checked} files in {len(shards)} shards"
                 + (f": {len(bad)} mismatches" if bad else " match their shards' digests.json and the manifest"),
                 {"mismatched": bad[:50]})


def check_basis(reader: CacheReader) -> Check:
    """A projected cache's basis.safetensors (pipeline/projection/basis_file.py): present, the
    basis the manifest's digest names, of its rank and as wide as the taps. Without it no stored
    row can be read back into taps, and a replaced one reads every row wrongly."""
    capture = reader.manifest.identity.capture
    try:
        basis = cache_basis(reader)
    except PipelineError as e:  # missing, not a basis, or another digest: one line naming the file
        return Check("basis", False, str(e))
    width = len(capture.target_layer_ids) * capture.hidden_size
    problems = [f"{BASIS}: {what} {got}, the manifest's capture says {want}"
                for what, got, want in (("rank", basis.projected_rank, capture.projected_rank), ("width", basis.width, width))
                if got != want]
    if problems:
        return Check("basis", False, "; ".join(problems), {"digest": basis.digest()})
    return Check("basis", True, f"{BASIS}: basis {basis.digest()[:12]} as the manifest names, {basis.projected_rank} "
                                f"components of {width} tap values, keeping {basis.energy:.3f} of the energy of a "
                                f"{basis.pilot_tokens}-token pilot",
                 {"digest": basis.digest(), "rank": basis.projected_rank, "width": width, "energy": basis.energy,
                  "pilot_tokens": basis.pilot_tokens})


def check_provenance(reader: CacheReader, shards: list[str]) -> Check:
    """Kernel path and tool environment agree across shards; each shard's repeated identity agrees
    with the cache's."""
    paths, envs, identity_problems = {}, {}, []
    identity = reader.manifest.identity
    for name in shards:
        rec = reader.manifest.shards[name]
        for d in reader.foreign.get(name, []):
            identity_problems.append(f"{name}: {shard_field_name(d.field)} {str(d.other)[:16]} differs from the cache's {str(d.recorded)[:16]}")
        paths.setdefault(rec.kernel_path, []).append(name)
        env = rec.environment or {}
        key = (env.get("torch"), env.get("transformers"), env.get("flash_linear_attention"), env.get("causal_conv1d"))
        envs.setdefault(str(key), []).append(name)
    capture = identity.capture
    ok = len(paths) <= 1 and "unknown" not in paths and not identity_problems
    summary = (f"kernel path {'/'.join(paths) or 'none'} across {len(shards)} shards"
               + ("" if len(paths) <= 1 else " (MIXED)")
               + (f" (UNKNOWN for {len(paths['unknown'])} shards: the linear-attention implementation was not identified)"
                  if "unknown" in paths else "")
               + (f"; {len(identity_problems)} shards disagree with the cache identity" if identity_problems else "")
               + f"; taps {capture.target_layer_ids}, hidden {capture.hidden_size}, vocab {capture.vocab_size}")
    return Check("provenance", ok, summary, {
        "problems": identity_problems[:50],
        "kernel_paths": {k: len(v) for k, v in paths.items()},
        "environments": {k: len(v) for k, v in envs.items()},
        "tokenizer": asdict(identity.tokenizer), "target": {k: v for k, v in asdict(identity.target).items() if k != "weights"},
        "capture": asdict(capture)})
