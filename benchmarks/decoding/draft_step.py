"""Drafter time per decoding step against the context length (issue 18): without a cache (each
step runs `fc`, the norms and every layer's k/v over the whole context: `draft_logits`) and with
the drafter's KV cache (`pipeline/drafter/incremental.py`: the block's tokens only, plus
committing the accepted positions).

    python benchmarks/decoding/draft_step.py [--hidden 128] [--layers 2] [--contexts 128,512,2048] [--json]

A drafter with random weights (tiny-preset geometry by default; `--hidden 1024` for a wider
one), 3 taps, block 16, fp32 on the CPU. Per context length T: the median over `--repeats`
steps of (a) the uncached step at T, (b) the cached step: drafting the block at T, then
committing 4 accepted positions (a typical acceptance). The cached step should not grow with T
(its full-attention layers read T cached keys for 16 queries, a small part).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.cli_args import at_least_one, positive_ints  # noqa: E402

from pipeline.drafter.incremental import DraftContext  # noqa: E402
from pipeline.drafter.model import DFlashDrafter, DrafterConfig  # noqa: E402
from pipeline.eval.speculative_decoding import draft_logits  # noqa: E402

TAPS, BLOCK, VOCAB, ACCEPTED = 3, 16, 4096, 4


def head_counts(hidden: int) -> tuple[int, int]:
    """(query heads, KV heads) of the drafter, 64 wide."""
    heads = max(2, hidden // 64)
    return heads, max(1, heads // 4)


def make_drafter(hidden: int, layers: int) -> DFlashDrafter:
    torch.manual_seed(0)
    heads, kv_heads = head_counts(hidden)
    config = DrafterConfig(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64,
                           vocab_size=VOCAB, target_layer_ids=[1, 3, 5], num_target_layers=8, mask_token_id=VOCAB - 1,
                           block_size=BLOCK)
    return DFlashDrafter(config, embed=torch.nn.Embedding(VOCAB, hidden), lm_head=torch.nn.Linear(hidden, VOCAB, bias=False)).eval()


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128,
                        help="drafter hidden size; query heads = max(2, hidden/64) (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="drafter layers (default %(default)s)")
    parser.add_argument("--contexts", default="128,512,2048",
                        help="context lengths in tokens, comma-separated (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed steps per context length; the median is reported (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not as a Python dict")
    args = parser.parse_args()
    # Bad values end here in one line, not in a traceback from the drafter or torch.
    heads, kv_heads = head_counts(args.hidden)
    if args.hidden < 1 or heads % kv_heads:
        parser.error(f"--hidden must be positive, with its max(2, hidden/64) query heads a multiple of its "
                     f"max(1, heads/4) KV heads (e.g. 128, 256, 1024), got {args.hidden}")
    at_least_one(parser, args, "layers", "repeats")
    contexts = positive_ints(parser, "--contexts", args.contexts)
    drafter = make_drafter(args.hidden, args.layers)
    rows = []
    for t in contexts:
        hidden = torch.randn(t + ACCEPTED * (args.repeats + 2), TAPS, args.hidden)
        before = median_seconds(lambda: draft_logits(drafter, hidden[:t], 7, t), args.repeats)
        cache = DraftContext(drafter)
        cache.extend(hidden[:t])

        def cached_step():
            cache.logits(7, cache.length)
            cache.extend(hidden[cache.length:cache.length + ACCEPTED])
        after = median_seconds(cached_step, args.repeats)
        rows.append({"context": t, "uncached_ms": round(1e3 * before, 3), "cached_ms": round(1e3 * after, 3),
                     "speedup": round(before / after, 2)})
    result = {"hidden": args.hidden, "layers": args.layers, "block": BLOCK, "threads": torch.get_num_threads(), "rows": rows}
    print(json.dumps(result, indent=1) if args.json else result)


if __name__ == "__main__":
    main()
