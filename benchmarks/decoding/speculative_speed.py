"""Speculative decoding where the target dominates the cost (issue 18), on the CPU.

    python benchmarks/decoding/speculative_speed.py [--target random|embedded] [--hidden 1024] [--layers 12]
        [--vocab 32768] [--prompts 6] [--prompt-len 256] [--max-new 64] [--budgets 16,64] [--json]

Two measurements in one run, on one target:
1. **Verify step vs tree nodes**: on a prompt of `--prompt-len` tokens, for each budget, the
   target tokens processed and the wall time (median of `--repeats`) of one DDTree verification
   plus its commit: `tree` (each node once: ancestor mask, per-node recurrent states) against
   `paths` (root-to-leaf paths as batch rows, the method before); and block verification of
   B tokens for scale.
2. **Speed vs greedy**: greedy, block, DDTree (tree verification) at each budget, and DDTree
   with path verification, prompt by prompt in turn (drift hits them alike), every output
   checked against greedy; then block and DDTree with all prompts in one batch (`decode_rows`,
   one verify pass per step for the batch) against the same greedy time.

The target: `random` = a transformers `Qwen3_5ForCausalLM` with random weights (every 4th layer
full attention, as Qwen3.6; about 230 M parameters at the defaults), or `embedded` = the
embedded tiny target (1.7 M). The drafter is an oracle (no drafter cost: this isolates the
target's side): for the anchor at position p it knows the target's greedy continuation and
ranks the right token first at each block slot with probability `--accuracy` (per slot, seeded);
otherwise a random token is first and the right one second (half the misses) or nowhere near the
top (the other half). So block decoding accepts a geometric run of slots and DDTree can recover
some misses, as with a trained drafter. Prompts are random token
ids. fp32, the CPU's threads.
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

from pipeline.eval.batched import decode_rows  # noqa: E402
from pipeline.eval.speculative_decoding import block_decode, greedy, tree_decode  # noqa: E402
from pipeline.target_model.live import LiveTarget  # noqa: E402
from pipeline.eval.tree import build_tree  # noqa: E402

BLOCK, TAPS = 16, [1, 3, 5]


def head_counts(hidden: int) -> tuple[int, int, int, int]:
    """(attention heads, KV heads, linear-attention key heads, value heads) of `random_target`, all 128 wide."""
    return hidden // 128, max(1, hidden // 512), hidden // 256, hidden // 128


def random_target(hidden: int, layers: int, vocab: int):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    heads, kv_heads, linear_k, linear_v = head_counts(hidden)
    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128,
        linear_num_key_heads=linear_k, linear_num_value_heads=linear_v, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=8192, tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    return Qwen3_5ForCausalLM(config).eval()


def embedded_target():
    from pipeline.embedded import TARGET_DIR
    from pipeline.target_model import load_target

    return load_target(TARGET_DIR)


class Oracle:
    """Draft logits [B-1, V] from the target's own greedy continuation (see the module docstring)."""

    def __init__(self, reference: list[int], start: int, vocab: int, accuracy: float, seed: int):
        self.reference, self.start, self.vocab, self.accuracy, self.seed = reference, start, vocab, accuracy, seed

    def __call__(self, anchor: int, pos: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + pos)
        logits = torch.randn(BLOCK - 1, self.vocab, generator=g)
        for k in range(1, BLOCK):
            i = pos - self.start + k            # index in the greedy output of the token at pos + k
            right = self.reference[i] if i < len(self.reference) else int(torch.randint(self.vocab, (1,), generator=g))
            u = torch.rand(1, generator=g).item()
            rank = 0 if u < self.accuracy else 1 if u < (1 + self.accuracy) / 2 else None
            if rank != 0:   # a random token first; the right one second, or out of the candidates
                logits[k - 1, (right + 1 + int(torch.randint(self.vocab - 1, (1,), generator=g))) % self.vocab] = 20.0
            logits[k - 1, right] = {0: 20.0, 1: 15.0, None: -20.0}[rank]
        return logits

    def tokens(self, anchor: int, pos: int) -> list[int]:
        return self(anchor, pos).argmax(-1).tolist()


def verify_costs(live: LiveTarget, vocab: int, prompt: list[int], budgets: list[int], repeats: int,
                 accuracy: float) -> list[dict]:
    state = live.run(prompt, None, 0, with_hidden=False).state
    reference = greedy(live, prompt, max_new=BLOCK + 1, eos=set()).tokens
    oracle = Oracle(reference, len(prompt), vocab, accuracy, seed=7)
    pos, bonus = len(prompt), reference[0]
    rows = []
    for budget in budgets:
        tree = build_tree(torch.log_softmax(oracle(bonus, pos), -1), budget, 8)
        tokens, parents = [bonus, *tree.tokens], [-1, *(p + 1 for p in tree.parents)]
        paths = tree.paths()
        width = max(len(p) for p in paths)
        path_rows = torch.tensor([[bonus] + [tree.tokens[n] for n in p] + [bonus] * (width - len(p)) for p in paths])
        deepest = max(paths, key=len)
        times = {"tree": [], "paths": []}
        for _ in range(repeats):
            for method in ("tree", "paths"):
                copy = LiveTarget.copy(state)
                t0 = time.perf_counter()
                if method == "tree":
                    live.commit_path(live.verify_tree(tokens, parents, copy, pos), [0, *(n + 1 for n in deepest)])
                else:
                    live.commit(live.verify_rows(path_rows, copy, pos), len(deepest) + 1, row=paths.index(deepest))
                times[method].append(time.perf_counter() - t0)
        rows.append({"budget": budget, "nodes": len(tokens), "depth": width, "paths": len(paths),
                     "tree_tokens": len(tokens), "paths_tokens": int(path_rows.numel()),
                     "tree_ms": 1e3 * statistics.median(times["tree"]), "paths_ms": 1e3 * statistics.median(times["paths"])})
    block = []
    for _ in range(repeats):
        copy = LiveTarget.copy(state)
        t0 = time.perf_counter()
        live.commit(live.verify(reference[:BLOCK], copy, pos, with_hidden=False), 4)
        block.append(time.perf_counter() - t0)
    rows.append({"budget": "block", "nodes": BLOCK, "tree_tokens": BLOCK, "tree_ms": 1e3 * statistics.median(block)})
    return rows


def decode_speed(live: LiveTarget, vocab: int, prompts: list[list[int]], budgets: list[int], max_new: int,
                 accuracy: float) -> dict:
    eos: set[int] = set()
    methods = ["greedy", "block", *(f"ddtree{b}" for b in budgets), *(f"ddtree{b}-paths" for b in budgets)]
    seconds, tokens, steps, accepted, identical = ({m: 0 for m in methods} for _ in range(5))
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        reference = greedy(live, prompt, max_new=max_new, eos=eos).tokens
        seconds["greedy"] += time.perf_counter() - t0
        tokens["greedy"] += len(reference)
        oracle = Oracle(reference, len(prompt), vocab, accuracy, seed=i)
        for m in methods[1:]:
            t0 = time.perf_counter()
            if m == "block":
                run = block_decode(live, None, prompt, max_new=max_new, eos=eos, draft=oracle.tokens)
            else:
                budget = int(m.removeprefix("ddtree").removesuffix("-paths"))
                run = tree_decode(live, None, prompt, max_new=max_new, eos=eos, budget=budget, draft=oracle,
                                  verify="paths" if m.endswith("-paths") else "tree")
            seconds[m] += time.perf_counter() - t0
            tokens[m] += len(run.tokens)
            steps[m] += len(run.accepted)
            accepted[m] += sum(run.accepted)
            identical[m] += run.tokens == reference
    references = [greedy(live, p, max_new=max_new, eos=eos).tokens for p in prompts]
    oracles = [Oracle(r, len(p), vocab, accuracy, seed=i) for i, (r, p) in enumerate(zip(references, prompts))]
    for budget in [None, *budgets]:
        m = "block-batch" if budget is None else f"ddtree{budget}-batch"
        methods.append(m)
        t0 = time.perf_counter()
        runs = decode_rows(live, None, prompts, max_new=max_new, eos=eos, budget=budget, draft=oracles)
        seconds[m] = time.perf_counter() - t0
        tokens[m] = sum(len(r.tokens) for r in runs)
        steps[m] = sum(len(r.accepted) for r in runs)
        accepted[m] = sum(sum(r.accepted) for r in runs)
        identical[m] = sum(r.tokens == ref for r, ref in zip(runs, references))
    return {m: {"tokens": tokens[m], "wall_s": seconds[m], "tokens_per_s": tokens[m] / seconds[m],
                "speed_vs_greedy": seconds["greedy"] / seconds[m],
                **({"tau": (accepted[m] + steps[m]) / steps[m], "identical_to_greedy": f"{identical[m]}/{len(prompts)}"}
                   if m != "greedy" else {})}
            for m in methods}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=["random", "embedded"], default="random",
                        help="random: random-weight Qwen3.5 sized by --hidden/--layers/--vocab; embedded: the 1.7 M tiny target")
    parser.add_argument("--hidden", type=int, default=1024,
                        help="hidden size of the random target, a multiple of 256 such as 512 or 2048 (default %(default)s)")
    parser.add_argument("--layers", type=int, default=12,
                        help=f"decoder layers of the random target, at least {max(TAPS) + 2}: taps fixed at {TAPS} "
                             "(default %(default)s)")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary of the random target (default %(default)s)")
    parser.add_argument("--prompts", type=int, default=6, help="random prompts decoded for the speed part (default %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt (default %(default)s)")
    parser.add_argument("--max-new", type=int, default=64, help="tokens generated per prompt (default %(default)s)")
    parser.add_argument("--budgets", default="16,64", help="DDTree node budgets, comma-separated (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timings of each verify step; the median is reported (default %(default)s)")
    parser.add_argument("--accuracy", type=float, default=0.8,
                        help="chance per block slot that the oracle drafter ranks the right token first, 0..1 "
                             "(default %(default)s)")
    parser.add_argument("--skip-decode", action="store_true", help="measure the verify step only, not the speed vs greedy")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    # Bad values end here in one line, not in a traceback from inside transformers or torch.
    if args.target == "random":  # --hidden, --layers and --vocab size the random target only
        heads, kv_heads, _, _ = head_counts(args.hidden)
        if args.hidden < 256 or args.hidden % 256 or heads % kv_heads:
            parser.error(f"--hidden must be a multiple of 256 whose hidden/128 heads are a multiple of its "
                         f"max(1, hidden/512) KV heads (e.g. 512, 1024, 2048), got {args.hidden}")
        if max(TAPS) >= args.layers - 1:  # a tap is never the last decoder layer (pipeline/target_model/taps.py)
            parser.error(f"--layers must be at least {max(TAPS) + 2} (taps fixed at {TAPS}), got {args.layers}")
        if args.vocab < 2:  # the oracle puts a wrong token first on a miss
            parser.error(f"--vocab must be at least 2, got {args.vocab}")
    at_least_one(parser, args, "prompts", "prompt_len", "max_new", "repeats")
    if not 0 <= args.accuracy <= 1:
        parser.error(f"--accuracy must be between 0 and 1, got {args.accuracy}")
    budgets = positive_ints(parser, "--budgets", args.budgets)

    model = random_target(args.hidden, args.layers, args.vocab) if args.target == "random" else embedded_target()
    vocab = model.config.vocab_size
    live = LiveTarget(model, TAPS)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(min(vocab, 512), (args.prompt_len,), generator=generator).tolist() for _ in range(args.prompts)]
    result = {"target": args.target, "parameters": sum(p.numel() for p in model.parameters()),
              "threads": torch.get_num_threads(), "prompt_len": args.prompt_len, "accuracy": args.accuracy,
              "verify_step": verify_costs(live, vocab, prompts[0], budgets, args.repeats, args.accuracy)}
    if not args.skip_decode:
        result["decode"] = decode_speed(live, vocab, prompts, budgets, args.max_new, args.accuracy)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.target} target, {result['parameters'] / 1e6:.1f} M parameters, {result['threads']} threads")
    for row in result["verify_step"]:
        if row["budget"] == "block":
            print(f"block {BLOCK}: {row['tree_tokens']} tokens, {row['tree_ms']:.1f} ms")
        else:
            print(f"budget {row['budget']}: tree {row['tree_tokens']} tokens {row['tree_ms']:.1f} ms | "
                  f"paths {row['paths']} x {row['depth']} = {row['paths_tokens']} tokens {row['paths_ms']:.1f} ms")
    for m, r in result.get("decode", {}).items():
        print(f"{m:>14}: {r['tokens_per_s']:7.1f} tok/s  {r['speed_vs_greedy']:.2f}x greedy"
              + (f"  tau {r['tau']:.2f}  identical {r['identical_to_greedy']}" if "tau" in r else ""))


if __name__ == "__main__":
    main()
