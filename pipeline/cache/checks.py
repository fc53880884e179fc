"""Model-free checks of a cache (DESIGN 5, 6): structure, checksums, finiteness, label
alignment, top-k consistency, provenance agreement across shards.

Each check returns a `Check`: a name, pass/fail, a one-line summary and the evidence. Memory
stays bounded: token arrays are read in windows of whole samples (at most WINDOW_TOKENS
tokens) and hidden states one chunk at a time.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pipeline.cache.encoding import decode_bf16, decode_fp8
from pipeline.cache.location import open_location
from pipeline.cache.files import digest_of_files
from pipeline.cache.manifest import shard_claims, shard_field_name
from pipeline.cache.reader import CacheReader, ShardReader
from pipeline.cache.schema import DIGESTS, array_specs, inner_shape
from pipeline.cache.commit import hash_shard, read_digests
from pipeline.errors import PipelineError

WINDOW_TOKENS = 1 << 18  # about 70 MB of per-token arrays at top-k 32


@dataclass
class Check:
    name: str
    passed: bool
    summary: str
    evidence: dict = field(default_factory=dict)
    skipped: bool = False
    inconclusive: bool = False   # ran, but the data cannot tell pass from fail (does not fail verification)

    def record(self) -> dict:
        status = "skipped" if self.skipped else "inconclusive" if self.inconclusive else ("pass" if self.passed else "fail")
        return {"check": self.name, "status": status, "summary": self.summary, "evidence": self.evidence}


def sound_shards(reader: CacheReader, shards: list[str]):
    """(name, ShardReader) for the shards that exist and whose declared shapes match the manifest;
    the others are reported by check_structure and never read."""
    for name in shards:
        if not reader.present(name):
            continue
        try:
            yield name, reader.shard(name)
        except PipelineError:
            continue


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
            length = shard.num_tokens if spec.per == "token" else (shard.num_samples + (spec.name == "offsets"))
            want = (length, *inner_shape(spec, dims))
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


def check_chunks(reader: CacheReader, shards: list[str], sample_rate: float, seed: int, progress=None) -> tuple[Check, Check, Check]:
    """Decode chunks (Zarr verifies each CRC32C on decode); count NaN/Inf per tap on the way, and
    collect each sample's tap signature (see check_tap_signature)."""
    rng = random.Random(seed)
    dims = reader.manifest.identity.capture.dims()
    n_taps = dims["n_taps"]
    nan, inf = np.zeros(n_taps, dtype=np.int64), np.zeros(n_taps, dtype=np.int64)
    decoded = total = 0
    failures = []
    bad_samples = SampleList()
    signatures = TapSignatures(n_taps)
    for name, shard in sound_shards(reader, shards):
        for spec in array_specs(reader.hidden_format):
            arr = shard.group[spec.name]
            step = arr.chunks[0]  # the inner chunk: the unit of decoding and of its CRC32C
            for a in range(0, arr.shape[0], step):
                total += 1
                if sample_rate < 1.0 and rng.random() >= sample_rate:
                    continue
                try:
                    block = shard.read_range(spec.name, a, a + step)
                except PipelineError as e:  # a checksum, index or codec error, naming the file
                    failures.append(f"{name}/{spec.name} chunk {a // step}: {str(e)[:200]}")
                    continue
                decoded += 1
                if spec.name == "hidden":
                    values = _decode_hidden(shard, block, a, reader.hidden_format)
                    nan += np.isnan(values).sum(axis=(0, 2))
                    inf += np.isinf(values).sum(axis=(0, 2))
                    tokens = a + np.flatnonzero(~np.isfinite(values).all(axis=(1, 2)))
                    bad_samples.add_tokens(shard, tokens)
                    signatures.add(name, shard, a, values)
        if progress:
            progress()
    crc = Check("checksums", not failures,
                f"{decoded} of {total} chunks decoded with CRC32C verified" + (f"; {len(failures)} failed" if failures else ""),
                {"failures": failures[:50], "decoded": decoded, "total": total, "sample_rate": sample_rate})
    finite = Check("finite", not (nan.any() or inf.any()), "NaN/Inf per tap: " + ", ".join(
        f"tap {t}: {int(n)}/{int(i)}" for t, n, i in zip(reader.manifest.identity.capture.target_layer_ids, nan, inf))
        + (f"; {bad_samples.describe()}" if bad_samples else ""),
        {"nan_per_tap": nan.tolist(), "inf_per_tap": inf.tolist(), **bad_samples.evidence()})
    if sample_rate < 1.0:
        signature = Check("tap_signature", True, "skipped: --sample-rate < 1 decodes only part of each sample", skipped=True)
    else:
        signature = signatures.check(reader.manifest.identity.capture.target_layer_ids)
    return crc, finite, signature


class TapSignatures:
    """Per sample and tap, the mean over tokens of log RMS(hidden state). The residual stream's
    scale grows with depth, so within a sample the step from one tap to the next is nearly the
    same in every sample (measured on the embedded target: robust z within +-2.9 over 1,000
    samples), while two taps swapped make a step change sign (z about -18 and beyond). A sample
    whose step is further than Z_LIMIT robust standard deviations from the cache's median is named.
    A model-free check: it catches swapped taps; a tap taken one layer off is only sometimes this
    far out (the tail recompute catches that for the deepest tap)."""

    Z_LIMIT = 8.0
    MIN_SAMPLES = 20  # fewer, and the spread is not known well enough to call anything an outlier

    def __init__(self, n_taps: int):
        self.n_taps = n_taps
        self.sums: dict[str, np.ndarray] = {}
        self.shards: dict[str, ShardReader] = {}

    def add(self, name: str, shard: ShardReader, a: int, values: np.ndarray) -> None:
        if name not in self.sums:
            self.sums[name] = np.zeros((shard.num_samples, self.n_taps))
            self.shards[name] = shard
        with np.errstate(divide="ignore", invalid="ignore"):
            log_rms = 0.5 * np.log(np.mean(np.square(values, dtype=np.float64), axis=-1))    # [tokens, taps]
        rows = np.searchsorted(shard.offsets, a + np.arange(len(values)), side="right") - 1
        np.add.at(self.sums[name], rows, log_rms)

    def check(self, taps: list[int]) -> Check:
        if self.n_taps < 2:
            return Check("tap_signature", True, "skipped: a single tap has no step to compare", skipped=True)
        order = np.argsort(taps)
        steps, where = [], []
        for name, sums in self.sums.items():
            lengths = np.diff(self.shards[name].offsets)[:, None]
            steps.append(np.diff((sums / lengths)[:, order], axis=1))
            where += [(name, int(sid)) for sid in self.shards[name].sample_ids]
        steps = np.concatenate(steps) if steps else np.zeros((0, self.n_taps - 1))
        finite = np.isfinite(steps).all(axis=1)
        if finite.sum() < self.MIN_SAMPLES:
            return Check("tap_signature", True, f"skipped: {int(finite.sum())} samples, fewer than {self.MIN_SAMPLES}",
                         skipped=True)
        median = np.median(steps[finite], axis=0)
        sigma = 1.4826 * np.median(np.abs(steps[finite] - median), axis=0) + 1e-6
        z = (steps - median) / sigma
        pairs = [f"tap {taps[order[j]]} -> {taps[order[j + 1]]}" for j in range(self.n_taps - 1)]
        offending = SampleList()
        for i in np.flatnonzero(finite & (np.abs(z) > self.Z_LIMIT).any(axis=1)):
            j = int(np.abs(z[i]).argmax())
            offending.add(*where[i], f"log-RMS step {pairs[j]} is {steps[i, j]:+.3f}, cache median {median[j]:+.3f} "
                                    f"(z {z[i, j]:+.1f}): taps swapped or from the wrong layer")
        summary = (f"{int(finite.sum())} samples: per-tap scale steps " + ", ".join(
            f"{p} {m:+.3f} (sd {s:.3f})" for p, m, s in zip(pairs, median, sigma))
            + (f"; {offending.describe()}" if offending else f"; none beyond {self.Z_LIMIT:g} sd"))
        return Check("tap_signature", not offending, summary,
                     {"median_step": median.tolist(), "robust_sd": sigma.tolist(), "z_limit": self.Z_LIMIT,
                      "max_abs_z": float(np.abs(z[finite]).max()), **offending.evidence()})


def _decode_hidden(shard: ShardReader, block: np.ndarray, a: int, hidden_format: str) -> np.ndarray:
    if hidden_format == "bf16":
        return decode_bf16(block).float().numpy()
    scale = shard.read_range("hidden_scale", a, a + len(block))
    return decode_fp8(block, scale).numpy()


def sample_windows(offsets: np.ndarray, max_tokens: int = WINDOW_TOKENS):
    """(first_row, last_row_exclusive) windows of whole samples, each at most max_tokens (or one sample)."""
    lo = 0
    while lo < len(offsets) - 1:
        hi = lo + 1
        while hi < len(offsets) - 1 and offsets[hi + 1] - offsets[lo] <= max_tokens:
            hi += 1
        yield lo, hi
        lo = hi


def check_alignment(reader: CacheReader, shards: list[str]) -> tuple[Check, Check]:
    """Label alignment (target_argmax[t-1] == input_ids[t] on supervised t, at shifts -1/0/+1)
    and top-k consistency over every sample, one window of whole samples at a time. A sample
    whose labels agree better at a shift than in place, or far below the cache's own agreement,
    is named: extractor bugs are often confined to some samples (DESIGN 10)."""
    hits = {-1: 0, 0: 0, 1: 0}
    counts = {-1: 0, 0: 0, 1: 0}
    topk_problems = {"argmax_not_top1": 0, "logits_not_sorted": 0, "logsumexp_below_max": 0}
    topk_samples = SampleList()
    per_sample = []  # (shard, sample id, supervised, hits at -1, 0, +1)
    tokens = 0
    for name, shard in sound_shards(reader, shards):
        for lo, hi in sample_windows(shard.offsets):
            a, b = int(shard.offsets[lo]), int(shard.offsets[hi])
            try:
                ids, mask, arg = (shard.read_range(k, a, b) for k in ("input_ids", "loss_mask", "target_argmax"))
                top_ids, top_logits, lse = (shard.read_range(k, a, b) for k in
                                            ("target_topk_ids", "target_topk_logits", "target_logsumexp"))
            except PipelineError:
                continue  # reported by the checksum check
            starts = (shard.offsets[lo:hi] - a).astype(np.int64)
            ends = (shard.offsets[lo + 1:hi + 1] - a).astype(np.int64)
            sample_of = np.repeat(np.arange(hi - lo), ends - starts)
            pos = np.arange(b - a) - starts[sample_of]
            length = (ends - starts)[sample_of]
            sample_hits = {}
            for shift in (-1, 0, 1):
                src = np.arange(b - a) - 1 + shift
                ok = (mask == 1) & (pos - 1 + shift >= 0) & (pos - 1 + shift < length) & (pos >= 1)
                idx = np.nonzero(ok)[0]
                same = arg[src[idx]] == ids[idx]
                hits[shift] += int(same.sum())
                counts[shift] += len(idx)
                sample_hits[shift] = np.bincount(sample_of[idx], weights=same, minlength=hi - lo)
                if shift == 0:
                    supervised = np.bincount(sample_of[idx], minlength=hi - lo)
            for k in range(hi - lo):
                per_sample.append((name, int(shard.sample_ids[lo + k]), int(supervised[k]),
                                   *(int(sample_hits[s][k]) for s in (-1, 0, 1))))
            bad = {"argmax_not_top1": arg != top_ids[:, 0],
                   "logits_not_sorted": (np.diff(top_logits, axis=1) > 0).any(axis=1),
                   "logsumexp_below_max": lse < top_logits[:, 0] - 1e-3}
            for key, flags in bad.items():
                topk_problems[key] += int(flags.sum())
            topk_samples.add_tokens(shard, a + np.flatnonzero(np.any(list(bad.values()), axis=0)))
            tokens += b - a
    rates = {s: hits[s] / counts[s] if counts[s] else None for s in hits}
    best = max((s for s in rates if rates[s] is not None), key=lambda s: rates[s], default=None)
    names = {-1: "t-2", 0: "t-1", 1: "t"}
    misaligned = misaligned_samples(per_sample, rates[0] or 0.0)
    summary = ", ".join(f"argmax[{names[s]}]==ids[t]: {rates[s]:.3f}" for s in (-1, 0, 1) if rates[s] is not None)
    # A target that predicts none of the data at any shift (random weights, or another model wrote
    # the data) says nothing about alignment: inconclusive, not a shift picked from noise.
    inconclusive = best is not None and rates[best] < INCONCLUSIVE_RATE and not misaligned
    aggregate_ok = best == 0 and rates[0] is not None and rates[0] > max(rates[-1] or 0, rates[1] or 0) + 0.05
    if inconclusive:
        summary = (f"the target's argmax agrees with the data at no shift ({summary}; all under "
                   f"{INCONCLUSIVE_RATE}), so alignment cannot be told (random weights, or the data was not written by this target)")
    elif not aggregate_ok and best is not None:
        summary += f" (best is argmax[{names[best]}]: labels look shifted by {best:+d})" if best else " (no clear winner)"
    summary = (summary or "no supervised positions") + f"; {len(per_sample)} samples checked"
    if misaligned:
        summary += f"; {misaligned.describe()}"
    alignment = Check("label_alignment", inconclusive or (aggregate_ok and not misaligned), summary,
                      {"rates_by_shift": {str(s): r for s, r in rates.items()}, "supervised_positions": counts[0],
                       "samples": len(per_sample), **misaligned.evidence()}, inconclusive=inconclusive)
    topk = Check("topk_consistency", not any(topk_problems.values()),
                 f"{tokens} tokens: " + ", ".join(f"{k} {v}" for k, v in topk_problems.items())
                 + (f"; {topk_samples.describe()}" if topk_samples else ""), {**topk_problems, **topk_samples.evidence()})
    return alignment, topk


# Below this agreement at every shift, label alignment cannot be told from agreement. A target that
# wrote its data agrees with it far above (the embedded target: about 0.97 in place).
INCONCLUSIVE_RATE = 0.02


def misaligned_samples(per_sample: list[tuple], cache_rate: float) -> "SampleList":
    """Samples whose labels agree better at a shift of one than in place (by at least 2 positions
    and 10% of their supervised positions), or, with 16+ supervised positions, at under half the
    cache's own agreement (the rate depends on whether the target wrote the data)."""
    out = SampleList()
    for name, sid, n, before, here, after in per_sample:
        shift, best = max(((-1, before), (1, after)), key=lambda x: x[1])
        if best - here >= max(2, 0.1 * n):
            out.add(name, sid, f"labels agree best at shift {shift:+d} ({best}/{n} vs {here}/{n} in place)")
        elif n >= 16 and here / n < 0.5 * cache_rate:
            out.add(name, sid, f"label agreement {here}/{n}, under half the cache's {cache_rate:.3f}")
    return out


class SampleList:
    """Offending samples: every id counted, the first few kept with the reason (bounded memory)."""

    KEEP = 20

    def __init__(self):
        self.count = 0
        self.first: list[str] = []
        self._seen: set[tuple[str, int]] = set()

    def add(self, shard: str, sample_id: int, reason: str = "") -> None:
        if (shard, sample_id) in self._seen:
            return
        self._seen.add((shard, sample_id))
        self.count += 1
        if len(self.first) < self.KEEP:
            self.first.append(f"sample {sample_id} ({shard})" + (f": {reason}" if reason else ""))

    def add_tokens(self, shard: ShardReader, tokens: np.ndarray) -> None:
        """The samples holding these token indices of `shard`."""
        if len(tokens):
            rows = np.unique(np.searchsorted(shard.offsets, tokens, side="right") - 1)
            for row in rows:
                self.add(shard.name, int(shard.sample_ids[row]))

    def __bool__(self) -> bool:
        return self.count > 0

    def describe(self) -> str:
        return f"{self.count} samples, e.g. {self.first[0]}" if self.count else "no sample"

    def evidence(self) -> dict:
        return {"offending_samples": self.count, "first_offending": self.first}


def check_provenance(reader: CacheReader, shards: list[str]) -> Check:
    """Kernel path and tool environment agree across shards; each shard's repeated identity agrees
    with the cache's."""
    paths, envs, identity_problems = {}, {}, []
    identity = reader.manifest.identity
    for name in shards:
        rec = reader.manifest.shards[name]
        for d in identity.differences(shard_claims(rec.identity or {})):
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


def open_cache(cache: str | Path) -> CacheReader:
    location = open_location(cache)
    location.check_reachable()
    return CacheReader(location)
