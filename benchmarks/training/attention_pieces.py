"""How many queries a piece of `split_block_attention` takes (the CPU training path's attention;
the constant `pipeline.drafter.attention_rule.PIECE_QUERIES` is chosen from this), side by side in
one run.

    python benchmarks/training/attention_pieces.py [--pieces 64,128,256,512] [--rounds 3] [--json]

Forward and backward of the attention alone (random queries, keys and values; sorted random
anchors) at three shapes: the demo's tiny drafter (block 8, 6 query heads / 1 KV head of 32, a
250-token context, 200 anchors), the same drafter on a 2,048-token context with 512 anchors,
and hidden 1024 (block 16, 16 / 4 heads of 64, 2,048 tokens x 512 anchors). A piece's queries
attend, in one SDPA call, to the context up to its last anchor and to the piece's own blocks:
a smaller piece wastes less on blocks it cannot see and on context after its anchors, a larger
one makes fewer calls and gathers the context fewer times. Medians of the rounds, milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cli_args import at_least_one, positive_ints  # noqa: E402
from pipeline.drafter.attention_rule import split_block_attention  # noqa: E402

SHAPES = {  # name: (context tokens, anchors, block, query heads, KV heads, head dim)
    "tiny, 250 tokens": (250, 200, 8, 6, 1, 32),
    "tiny, 2,048 tokens": (2048, 512, 8, 6, 1, 32),
    "hidden 1024, 2,048 tokens": (2048, 512, 16, 16, 4, 64),
}


def milliseconds(shape: tuple[int, ...], pieces: list[int], rounds: int) -> dict[int, float]:
    """Median forward + backward time per piece size (queries), rounds alternating the sizes."""
    context, anchors, block, heads, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(0)
    queries = anchors * block
    q = torch.randn(1, heads, queries, dim, generator=generator, requires_grad=True)
    k = torch.randn(1, kv_heads, context + queries, dim, generator=generator, requires_grad=True)
    v = torch.randn(1, kv_heads, context + queries, dim, generator=generator, requires_grad=True)
    chosen = torch.randperm(context - 1, generator=generator)[:anchors] + 1
    anchors_BA = chosen.sort().values[None]
    grad = torch.randn(1, heads, queries, dim, generator=generator)
    times: dict[int, list[float]] = {p: [] for p in pieces}
    for _ in range(rounds):
        for p in pieces:
            start = time.perf_counter()
            split_block_attention(q, k, v, context, anchors_BA, None, piece_anchors=max(1, p // block)).backward(grad)
            times[p].append(time.perf_counter() - start)
            q.grad = k.grad = v.grad = None
    return {p: round(statistics.median(t) * 1e3, 1) for p, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pieces", default="64,128,256,512", help="queries per piece to compare, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="rounds alternating the piece sizes (medians reported)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not as lines")
    args = parser.parse_args()
    at_least_one(parser, args, "rounds")
    pieces = positive_ints(parser, "--pieces", args.pieces)
    result = {"threads": torch.get_num_threads(), "rounds": args.rounds,
              "ms": {name: milliseconds(shape, pieces, args.rounds) for name, shape in SHAPES.items()}}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for name, row in result["ms"].items():
        best = min(row, key=row.get)
        print(f"{name:>26}: " + ", ".join(f"{p} queries {ms} ms" for p, ms in row.items()) + f"  (fastest: {best})")


if __name__ == "__main__":
    main()
