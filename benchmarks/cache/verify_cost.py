"""What the default verify-cache costs next to the extraction that wrote the cache.

    python benchmarks/cache/verify_cost.py [--shards 8] [--json]

1. Extract the embedded target's 1,000 training conversations (default options), timed.
2. `run_verify` at default options on that cache (every model-free check over every sample,
   loss masks re-derived for every sample, tail recompute of every sample), timed, with the
   tail check's own seconds.
3. Tail vs full forward on the same samples and batches, alternating rounds: the layers after the
   deepest tap + final norm (what the tail check runs) against the whole decoder stack + final
   norm from the token ids. The lm_head is the same in both and left out.
The projection for Qwen3.6-27B is by layer count (see BENCHMARKS.md), not measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.cache.reader import CacheReader  # noqa: E402
from pipeline.target_model.capture import tail_forward  # noqa: E402
from pipeline.config import ExtractConfig  # noqa: E402
from pipeline.embedded import TARGET_DIR  # noqa: E402
from pipeline.target_model import load_target  # noqa: E402
from pipeline.data.samples import length_batches  # noqa: E402
from pipeline.records.verify_result import VerifyResult  # noqa: E402
from stages.extract.run import run_extract  # noqa: E402
from stages.verify_cache.options import VerifyOptions
from stages.verify_cache.run import run_verify  # noqa: E402


def tail_vs_full(cache: Path, rounds: int = 3) -> dict:
    model = load_target(TARGET_DIR)
    reader = CacheReader(cache)
    taps = reader.manifest.identity.capture.target_layer_ids
    deepest, k = max(taps), taps.index(max(taps))
    samples = []
    for name in reader.shards:
        shard = reader.shard(name)
        for sid in shard.sample_ids:
            samples.append((int(sid), shard.read("input_ids", int(sid)).tolist(), shard.hidden(int(sid))[:, k].float()))
    batches = length_batches([(sid, ids, tap) for sid, ids, tap in samples], 8192)
    times = {"tail": [], "full": []}
    with torch.no_grad():
        for _ in range(rounds):
            start = time.perf_counter()
            for batch in batches:
                tail_forward(model, deepest, [tap for _, _, tap in batch])
            times["tail"].append(time.perf_counter() - start)
            start = time.perf_counter()
            for batch in batches:
                width = max(len(ids) for _, ids, _ in batch)
                x = torch.zeros(len(batch), width, dtype=torch.long)
                for row, (_, ids, _) in enumerate(batch):
                    x[row, :len(ids)] = torch.tensor(ids)
                model.model(input_ids=x, use_cache=False)
            times["full"].append(time.perf_counter() - start)
    tail, full = statistics.median(times["tail"]), statistics.median(times["full"])
    layers = reader.manifest.identity.capture.num_hidden_layers
    return {"tail_s": tail, "full_s": full, "tail_over_full": tail / full, "rounds": times,
            "layers_in_tail": layers - 1 - deepest, "num_hidden_layers": layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8,
                        help="shards of the embedded target's extraction (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not as key: value lines")
    args = parser.parse_args()
    if args.shards < 1:  # one line, not a traceback from the extraction
        parser.error(f"--shards must be at least 1, got {args.shards}")
    root = Path(tempfile.mkdtemp(prefix="dflash-verify-cost-"))
    try:
        start = time.perf_counter()
        extract = run_extract(ExtractConfig(cache=str(root / "cache"), num_shards=args.shards), None, progress=False)
        extract_s = time.perf_counter() - start
        start = time.perf_counter()
        report = run_verify(VerifyOptions(cache=root / "cache"))
        verify_s = time.perf_counter() - start
        tail = VerifyResult.from_json(report).check("tail_recompute").evidence
        result = {"tokens": extract["tokens"], "samples": extract["samples"], "extract_s": extract_s,
                  "verify_s": verify_s, "verify_over_extract": verify_s / extract_s, "verify_passed": report["passed"],
                  "tail_check_s": tail["seconds"], "tail_samples": tail["samples"],
                  "tail_vs_full_forward": tail_vs_full(root / "cache")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=1) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
