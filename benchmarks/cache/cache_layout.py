"""Cache layout at scale (issue 15): files, commit time and read rate, measured on real shards.

    python benchmarks/cache/cache_layout.py [--json] [--skip-commit] [--skip-read]

Runs against whichever tree is on sys.path first, so the same script measures the schema-1
writer of an older checkout (`PYTHONPATH=<old checkout> python benchmarks/cache/cache_layout.py`)
and the current one; it uses only the ShardWriter / CacheReader API both have.

1. Files: one shard of 32,768 tokens written at a reduced width (5 taps x 512, 5,120 bytes a
   token, 8x narrower than Qwen3.6-27B), default chunking; files and directories counted on
   disk, next to the schema's formula at that width and at the flagship width per 1e9 tokens.
2. Commit time vs shard size: shards of 32,768 / 131,072 / 524,288 tokens (1x, 4x, 16x) at the
   reduced width; the time of `commit()` alone (appends excluded), 2 repeats, median.
3. Read rate at the flagship width (5 taps x 5,120, 51,200 bytes a token, default chunking),
   one shard of 32,768 tokens in samples of 256..4,096 tokens: decoded hidden-state bytes per
   second of wall and of CPU time, reading whole samples in order and in shuffled order (the
   trainer's access, with its 256 MiB chunk cache; medians over interleaved rounds), next to
   zstd's own decode rate on the same stored frames (into one reused buffer: the limit; and into a new buffer per sample, as any
   reader that returns new arrays must) and a memory copy of the same bytes (the ceiling).
   glibc returns a freed buffer this large to the OS and page-faults the next one in; run with
   MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483647, or with --as-train
   (what `pipeline train` does in-process: pipeline.allocator.keep_freed_buffers_mapped), to
   keep them mapped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pipeline.cache.schema as schema  # noqa: E402
from pipeline.cache.encoding import encode_bf16  # noqa: E402
from pipeline.cache.reader import CacheReader  # noqa: E402
from pipeline.cache.writer import ShardWriter  # noqa: E402

TAPS, TOP_K = 5, 32
REDUCED, FLAGSHIP = 512, 5120
TREE = "schema 2 (sharded)" if schema.SCHEMA_VERSION >= 2 else f"schema {schema.SCHEMA_VERSION} (file per chunk)"


def hidden_block(tokens: int, hidden: int, seed: int = 0) -> np.ndarray:
    """bf16 bit patterns shaped like a residual stream: per-channel scales, heavy-ish tails."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(TAPS, hidden, generator=g) * 0.7)
    x = torch.randn(tokens, TAPS, hidden, generator=g) * scale
    return encode_bf16(x)


def sample_lengths(total: int, seed: int = 0) -> list[int]:
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(rng.randint(256, 4096))
    out[-1] -= sum(out) - total
    if out[-1] <= 0:
        out.pop()
        out[-1] += total - sum(out)
    return out


def write_shard(cache: Path, index: int, tokens: int, hidden: int, block: np.ndarray) -> tuple[dict, float, float]:
    """(record, seconds appending, seconds in commit)."""
    dims = {"n_taps": TAPS, "hidden_size": hidden, "top_k": TOP_K}
    writer = ShardWriter(cache, index, dims=dims, hidden_format="bf16", num_tokens=tokens)
    rng = np.random.default_rng(index)
    start, pos = time.perf_counter(), 0
    for sid, n in enumerate(sample_lengths(tokens, index)):
        rows = np.arange(pos, pos + n) % len(block)
        ids = rng.integers(0, 248_000, n, dtype=np.int32)
        writer.append(sid, {
            "input_ids": ids, "loss_mask": np.ones(n, np.uint8), "target_argmax": ids,
            "target_topk_ids": rng.integers(0, 248_000, (n, TOP_K), dtype=np.int32),
            "target_topk_logits": np.sort(rng.standard_normal((n, TOP_K), dtype=np.float32))[:, ::-1],
            "target_logsumexp": rng.standard_normal(n, dtype=np.float32), "hidden": block[rows]})
        pos += n
    appended = time.perf_counter()
    record = writer.commit()
    committed = time.perf_counter() - appended
    record["_fsync_s"] = getattr(writer, "fsync_seconds", None)  # schema 2 times its fsync separately
    return record, appended - start, committed


def count_tree(root: Path) -> tuple[int, int]:
    files = dirs = 0
    for _, dirnames, filenames in os.walk(root):
        files += len(filenames)
        dirs += len(dirnames)
    return files, dirs


def files_formula(hidden: int, tokens: float) -> dict:
    """Data files per `tokens` tokens at this width, for schema 1 and schema 2 defaults."""
    per_token_hidden = TAPS * hidden * 2
    v1_chunk = max(16, (4 * 2**20) // per_token_hidden)
    v1_chunk = 1 << (v1_chunk.bit_length() - 1)
    v1 = tokens / v1_chunk + 6 * tokens / 65_536
    v2 = tokens / (v1_chunk * 256) + 6 * tokens / (65_536 * 16)
    # schema 1 also made two directories per hidden chunk index (c/<i>/ and c/<i>/0/)
    return {"schema1_files": v1, "schema1_inodes": v1 + 2 * tokens / v1_chunk, "schema2_files": v2}


def measure_files(root: Path) -> dict:
    block = hidden_block(8192, REDUCED)
    cache = root / "files"
    cache.mkdir()
    tokens = 32_768
    write_shard(cache, 0, tokens, REDUCED, block)
    files, dirs = count_tree(cache / "shard-00000")
    return {"tree": TREE, "tokens": tokens, "width_bytes": TAPS * REDUCED * 2, "files": files, "dirs": dirs,
            "formula_reduced": files_formula(REDUCED, tokens),
            "formula_flagship_per_1e9": files_formula(FLAGSHIP, 1e9)}


def measure_commit(root: Path, repeats: int) -> list[dict]:
    block = hidden_block(8192, REDUCED, seed=1)
    out = []
    for tokens in (32_768, 131_072, 524_288):
        times, appends, fsyncs = [], [], []
        for r in range(repeats):
            cache = root / f"commit-{tokens}-{r}"
            cache.mkdir()
            record, appended, committed = write_shard(cache, 0, tokens, REDUCED, block)
            times.append(committed)
            appends.append(appended)
            fsyncs.append(record.pop("_fsync_s"))
            files, _ = count_tree(cache / "shard-00000")
            shutil.rmtree(cache)
        out.append({"tokens": tokens, "stored_bytes": record["bytes"], "files": files,
                    "commit_s": statistics.median(times), "append_s": statistics.median(appends),
                    "fsync_s": statistics.median(fsyncs) if None not in fsyncs else None})
        print(f"  commit {tokens:>7} tokens: {statistics.median(times):.3f} s (appends {statistics.median(appends):.1f} s, "
              f"{files} files)", file=sys.stderr)
    return out


def rate(nbytes: int, fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return nbytes / (time.perf_counter() - wall) / 1e9, nbytes / (time.process_time() - cpu) / 1e9


def stored_frames(shard_dir: Path) -> list[bytes]:
    """The zstd frames of the hidden array as stored (CRC32C stripped), whatever the schema."""
    import zarr

    array = zarr.open_array(str(shard_dir / "hidden"), mode="r")
    frames = []
    if getattr(array, "shards", None):
        per_file = array.shards[0] // array.chunks[0]
        for f in sorted((shard_dir / "hidden").glob("c.*")):
            data = f.read_bytes()
            index = np.frombuffer(data[-(per_file * 16 + 4):-4], "<u8").reshape(per_file, 2)
            frames += [data[int(o):int(o + n) - 4] for o, n in index if o != 2**64 - 1]
    else:
        frames = [p.read_bytes()[:-4] for p in sorted((shard_dir / "hidden" / "c").rglob("*")) if p.is_file()]
    return frames


def synthetic_manifest(hidden: int):
    """A manifest for shards written by `write_shard` (no target ran: its identity is made up)."""
    from pipeline.cache.identity import parse_identity
    from pipeline.cache.manifest import SourcesRecord, new_manifest

    made_up = "synthetic (benchmarks/cache_layout.py)"
    identity = parse_identity({
        "num_shards": 1,
        "target": {"model_type": made_up, "config_sha256": made_up, "num_hidden_layers": 64, "weights": {}},
        "tokenizer": {"files_sha256": made_up, "chat_template_sha256": made_up, "chat_template_kwargs": None,
                      "thinking": "on", "generation_prompt": "", "reasoning": "keep", "boundary_tokens": made_up,
                      "end_of_turn": "<|im_end|>"},
        "data": {"num_rows": 0, "files": [], "generated_by": made_up},
        "capture": {"target_layer_ids": list(range(TAPS)), "tap_convention": made_up, "num_hidden_layers": 64,
                    "hidden_size": hidden, "vocab_size": 248_320, "top_k": TOP_K, "hidden_format": "bf16",
                    "stored_dtype": made_up, "compute_dtype": "bfloat16", "max_length": 1 << 20, "overlong": "error",
                    "on_error": "fail", "zstd_level": 3, "checksum": made_up,
                    "storage": schema.Chunking().record()}})
    plan = {"assignment": made_up, "num_rows": 0, "num_shards": 1, "storage": {}}
    return new_manifest(identity=identity, provenance={}, plan=plan, sources=SourcesRecord())


def measure_read(root: Path, repeats: int) -> dict:
    from numcodecs import Zstd

    cache = root / "read"
    cache.mkdir()
    tokens = 32_768
    block = hidden_block(8192, FLAGSHIP, seed=2)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record, _, _ = write_shard(cache, 0, tokens, FLAGSHIP, block)
    record.pop("_fsync_s")
    writer_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    from pipeline.files import write_json_atomic
    manifest = synthetic_manifest(FLAGSHIP).with_shard("shard-00000", record)
    write_json_atomic(cache / "manifest.json", manifest.to_json())
    reader = CacheReader(cache)
    ids = [int(s) for s in reader.shard(0).sample_ids]
    raw = tokens * TAPS * FLAGSHIP * 2
    results = {"tree": TREE, "tokens": tokens, "raw_hidden_bytes": raw, "writer_peak_rss_growth_bytes": writer_peak,
               "stored_hidden_bytes":
               sum(p.stat().st_size for p in (cache / "shard-00000" / "hidden").rglob("*") if p.is_file())}
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    frames = stored_frames(cache / "shard-00000")
    raw_chunk = raw // len(frames)
    out = np.empty(raw_chunk, np.uint8)
    zstd = Zstd()
    per_sample = max(1, round(2176 / (raw_chunk / (TAPS * FLAGSHIP * 2))))  # frames in a mean-length sample
    chunks = [np.frombuffer(np.random.default_rng(0).bytes(raw_chunk), np.uint8) for _ in range(8)]

    def fresh():  # what any reader returning new arrays pays: a new output buffer per sample
        for i in range(0, len(frames), per_sample):
            sample = np.empty(raw_chunk * len(frames[i:i + per_sample]), np.uint8)
            for j, f in enumerate(frames[i:i + per_sample]):
                zstd.decode(f, out=sample[j * raw_chunk:(j + 1) * raw_chunk])

    def read(order, cache_bytes):  # a fresh reader each round (its chunk cache starts empty)
        shard = reader.shard(0, chunk_cache_bytes=cache_bytes)
        for s in order:  # each sample dropped after reading, as a consumer would
            shard.read("hidden", s)

    # Rounds interleave every measurement, so drift on this noisy machine hits all of them alike;
    # the median over rounds is reported (and the best round, for reference).
    sides = {"sequential": lambda: read(ids, 0), "shuffled": lambda: read(shuffled, 256 * 2**20),
             "zstd_limit": lambda: [zstd.decode(f, out=out) for f in frames], "zstd_fresh_output": fresh,
             "memcpy": lambda: [np.copyto(out, chunks[i % 8]) for i in range(len(frames))]}
    runs = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            runs[name].append(rate(raw, fn))
    for name, values in runs.items():
        results[name] = {"wall_GBps": statistics.median(v[0] for v in values),
                         "cpu_GBps": statistics.median(v[1] for v in values),
                         "best_wall_GBps": max(v[0] for v in values), "rounds": [round(v[0], 3) for v in values]}
    for key in ("sequential", "shuffled"):
        results[key]["of_zstd"] = results[key]["wall_GBps"] / results["zstd_limit"]["wall_GBps"]
        results[key]["of_zstd_fresh_output"] = results[key]["wall_GBps"] / results["zstd_fresh_output"]["wall_GBps"]
    results["malloc_env"] = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as one line of JSON, not indented")
    parser.add_argument("--skip-commit", action="store_true", help="skip the commit time vs shard size (part 2)")
    parser.add_argument("--skip-read", action="store_true", help="skip the read rate at the flagship width (part 3)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="commit repeats; read rounds are 2 x this + 1 (default %(default)s)")
    parser.add_argument("--as-train", action="store_true",
                        help="read as `pipeline train` does: keep_freed_buffers_mapped() first (schema 2 tree only)")
    args = parser.parse_args()
    if args.repeats < 1:  # the medians need one measurement at least
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    torch.set_num_threads(1)
    if args.as_train:
        from pipeline.allocator import keep_freed_buffers_mapped
        print(f"keep_freed_buffers_mapped: {keep_freed_buffers_mapped()}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="dflash-layout-") as tmp:
        root = Path(tmp)
        result = {"tree": TREE, "files": measure_files(root)}
        print(f"{TREE}: files {result['files']['files']}, dirs {result['files']['dirs']}", file=sys.stderr)
        if not args.skip_commit:
            result["commit"] = measure_commit(root, args.repeats)
        if not args.skip_read:
            result["read"] = measure_read(root, 2 * args.repeats + 1)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
