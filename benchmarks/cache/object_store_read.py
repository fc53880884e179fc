"""Caches in an object store: the trainer's read path from a bucket vs the same bytes on local disk.

    python benchmarks/cache/object_store_read.py [--tokens 32768] [--hidden 1024] [--rounds 3] [--json]

Writes one shard of synthetic taps (5 taps x HIDDEN, bf16 bit patterns of N(0, 1) values, the
default chunking) with the real shard writer into a directory and into a bucket on a moto server
started on 127.0.0.1 (loopback: no network latency, and the server shares this machine's cores),
then reads every sample's taps through the real ShardReader in a shuffled order, the two
locations interleaved per round. Reports the decoded rate (GB/s of raw taps), the client's CPU
seconds per GB (process CPU time: decoding, CRC32C and, for the bucket, the HTTP client), and per
request costs on loopback: wall time and client CPU time of a 4 KB range read and of one inner
chunk's range. moto is a Python server on the same cores, so the bucket's wall-clock rate here is
moto's, not S3's; the client's CPU per GB is the transferable number. From it, and Little's law,
the script projects the requests that must be in flight to feed 1.3 GB/s of raw taps per GPU
(DESIGN 11) at a 50 ms first-byte latency, for a few per-connection rates: a projection, not a
measurement against a real store.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))

from benchmarks.cli_args import at_least_one  # noqa: E402

FLAGSHIP_RATE = 1.3e9          # bytes/s of raw taps per GPU at the seeds' training rate
FLAGSHIP_TOKEN_BYTES = 51_200  # 5 taps x 5120 x 2 bytes
LATENCY = 0.050                # first-byte latency assumed for a real object store


def write_shard(location, tokens: int, hidden: int, sample_tokens: int = 2048) -> dict:
    from pipeline.cache.encoding import encode_bf16
    from pipeline.cache.writer import ShardWriter

    import torch

    rng = np.random.default_rng(0)
    dims = {"n_taps": 5, "hidden_size": hidden, "top_k": 8}
    writer = ShardWriter(location, 0, dims=dims, hidden_format="bf16", num_tokens=tokens)
    start, sid = 0, 0
    while start < tokens:
        n = min(sample_tokens, tokens - start)
        rows = {"input_ids": rng.integers(0, 1000, n, dtype=np.int32), "loss_mask": np.ones(n, np.uint8),
                "target_argmax": rng.integers(0, 1000, n, dtype=np.int32),
                "target_topk_ids": rng.integers(0, 1000, (n, 8), dtype=np.int32),
                "target_topk_logits": rng.standard_normal((n, 8), dtype=np.float32),
                "target_logsumexp": rng.standard_normal(n, dtype=np.float32),
                "hidden": encode_bf16(torch.from_numpy(rng.standard_normal((n, 5, hidden), dtype=np.float32)))}
        writer.append(sid, rows)
        start, sid = start + n, sid + 1
    return writer.commit()


def read_all(location, order: list[int]) -> tuple[float, float, int]:
    """(wall seconds, process CPU seconds, raw bytes) for every sample's taps in `order`."""
    from pipeline.cache.reader import ShardReader

    prefix = "shard-00000/"
    files = {k[len(prefix):]: v for k, v in location.listing(prefix).items()}
    wall, cpu = time.perf_counter(), time.process_time()
    shard = ShardReader(location, "shard-00000", "bf16", files=files)
    nbytes = 0
    for i in order:
        nbytes += shard.read("hidden", int(shard.sample_ids[i])).nbytes
    return time.perf_counter() - wall, time.process_time() - cpu, nbytes


def request_costs(location, key: str, size: int, chunk: int, repeats: int = 30) -> dict:
    """Median wall and client CPU seconds of a 4 KB range read and of a chunk-sized one."""
    out = {}
    for name, length in (("small", 4096), ("chunk", chunk)):
        wall, cpu = [], []
        for i in range(repeats):
            offset = (i * 7919 * 4096) % max(size - length, 1)
            t, c = time.perf_counter(), time.process_time()
            location.read_ranges(key, [(offset, offset + length)])
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        out[name] = {"bytes": length, "wall_s": statistics.median(wall), "client_cpu_s": statistics.median(cpu)}
    return out


def projection(cpu_s_per_gb: float) -> dict:
    """Little's law at the flagship rate: in flight = requests/s x seconds per request, where a
    request takes the first-byte latency plus its bytes at the per-connection rate. The reader
    asks for a sample's chunks of one file in one call whose adjacent ranges are coalesced, so a
    request is about one sample's taps (3,072 tokens x 51,200 B = 157 MB); uncoalesced, an inner
    chunk (64 tokens, 3.3 MB)."""
    rows = []
    for request in (3072 * FLAGSHIP_TOKEN_BYTES, 64 * FLAGSHIP_TOKEN_BYTES):
        per_s = FLAGSHIP_RATE / request
        for per_connection in (50e6, 100e6, 200e6):
            rows.append({"request_bytes": request, "per_connection_bytes_per_s": per_connection,
                         "requests_per_s": per_s, "in_flight": per_s * (LATENCY + request / per_connection)})
    return {"rows": rows, "client_cores": cpu_s_per_gb * FLAGSHIP_RATE / 1e9,
            "note": "projection: 50 ms first byte and the per-connection rates are assumptions, not measured"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens in the shard (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size of each of the 5 taps (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both reads (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    at_least_one(parser, args, "tokens", "hidden", "rounds")

    import tempfile

    from harness.s3_server import MotoServer

    from pipeline.cache.location import LocalLocation
    from pipeline.cache.object_store import S3Location

    server = MotoServer()
    try:
        import os
        os.environ.update(server.env())
        bucket = server.new_bucket()
        with tempfile.TemporaryDirectory() as tmp:
            local = LocalLocation(Path(tmp) / "cache")
            local.ensure_root()
            remote = S3Location.from_url(f"s3://{bucket}/cache")
            timings = {}
            for name, location in (("directory", local), ("bucket", remote)):
                t = time.perf_counter()
                record = write_shard(location, args.tokens, args.hidden)
                timings[name] = time.perf_counter() - t
            samples = record["samples"]
            rows = {"directory": [], "bucket": []}
            for r in range(args.rounds):
                order = list(range(samples))
                random.Random(r).shuffle(order)
                for name, location in (("directory", local), ("bucket", remote)):
                    rows[name].append(read_all(location, order))
            hidden_key = "shard-00000/hidden/c.0.0.0"
            size = remote.listing("shard-00000/")[hidden_key]
            from pipeline.cache.schema import Chunking, array_specs
            spec = next(s for s in array_specs("bf16") if s.name == "hidden")
            chunk_tokens = Chunking().chunk_tokens(spec, {"n_taps": 5, "hidden_size": args.hidden, "top_k": 8})
            chunk_bytes = int(chunk_tokens * 5 * args.hidden * 2 * 0.9)  # about one compressed inner chunk
            costs = request_costs(remote, hidden_key, size, chunk_bytes)
    finally:
        server.stop()

    def summary(name):
        wall = statistics.median(w for w, _, _ in rows[name])
        cpu = statistics.median(c for _, c, _ in rows[name])
        nbytes = rows[name][0][2]
        return {"gb_per_s": nbytes / wall / 1e9, "cpu_s_per_gb": cpu / (nbytes / 1e9), "raw_bytes": nbytes,
                "write_s": timings[name]}

    result = {"tokens": args.tokens, "hidden": args.hidden, "samples": samples, "rounds": args.rounds,
              "directory": summary("directory"), "bucket": summary("bucket"), "requests": costs}
    result["projection"] = projection(result["bucket"]["cpu_s_per_gb"])
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for name in ("directory", "bucket"):
        s = result[name]
        print(f"{name:10s} read {s['gb_per_s']:.3f} GB/s of raw taps, {s['cpu_s_per_gb']:.2f} CPU s/GB, "
              f"write {s['write_s']:.2f} s")
    for name, c in costs.items():
        print(f"request {name:5s} {c['bytes'] / 1e6:8.3f} MB: {c['wall_s'] * 1e3:7.1f} ms wall, "
              f"{c['client_cpu_s'] * 1e3:6.2f} ms client CPU")
    p = result["projection"]
    for row in p["rows"]:
        print(f"projection: {row['request_bytes'] / 1e6:6.1f} MB requests at {row['per_connection_bytes_per_s'] / 1e6:.0f} "
              f"MB/s per connection: {row['requests_per_s']:6.1f}/s, {row['in_flight']:5.1f} in flight")
    print(f"projection: {p['client_cores']:.2f} client cores per GPU at 1.3 GB/s (decode + HTTP, this machine's cores)")


if __name__ == "__main__":
    main()
