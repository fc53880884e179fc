"""A draft vocabulary (issue 58): what it saves at the flagship width, what it costs in acceptance
on the embedded target, and the coverage a chosen vocabulary gives on data it was not chosen from.

    python benchmarks/training/draft_vocab.py step [--layers 1] [--anchors 512] [--ks 248320,65536,32768]
    python benchmarks/training/draft_vocab.py drafting [--layers 1] [--batches 1,8] [--ks ...]
    python benchmarks/training/draft_vocab.py embedded --work DIR [--ks 128,256] [--steps 250] [--prompts 64]
    python benchmarks/training/draft_vocab.py coverage --work DIR [--k 32768] [--rows 400]

step: one training micro-step at the flagship width (hidden 5120, 32 q / 8 KV heads x 128,
intermediate 17408, 5 taps, a 248,320-token target vocabulary; random weights, fp32 on the CPU;
one sequence of 3,072 tokens with `--anchors` x block 16 query slots), forward + chunked loss +
metrics + backward, at each K (K = 248,320: no draft vocabulary), each in a fresh process: its
time, its peak RSS above the level before it (/proc/self/clear_refs), and, in the next process,
the time of the step's matrix-multiply floor at that K (benchmarks/training/peers_impls.py `GemmFloor`,
same shapes and threads). Labels are drawn from the first 32,768 ids, so every vocabulary holds every label and
each K runs the head on the same rows (a vocabulary that dropped labels would look faster for it).
drafting: one drafting step of `--batches` prompts (16 slots each, a cached context of 1,024
positions): the drafter's layers, the head, the draft logits scattered into the target's
vocabulary and the argmax, as eval runs it (median of repeats).
embedded: `pipeline train` on the embedded target (the tiny preset, a cache of the first 400
training conversations in 2 shards, `--steps` steps, seed 0) at each K and without a vocabulary,
then `pipeline eval` (greedy; block and DDTree 16/64) on the first `--prompts` held-out prompts:
coverage (run.json), the outside share in the last log line, tau pooled, and identical-to-greedy.
coverage: the real Qwen3.6 tokenizer (shared fixtures) on a random-weight target of its 248,320
rows (pipeline/toy/random_target.py), a cache of `--rows` embedded conversations in 4 shards; a K
vocabulary chosen from shards 0-1 and its coverage of the labels of shards 2-3 (and of 0-1).
A random target's argmax is not language: this shows the machinery and the rule at the real
vocabulary, not the coverage a real target's data gets (README: Draft vocabulary says how to
measure that on a first real shard).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.cli_args import at_least_one, positive_ints  # noqa: E402

HIDDEN, VOCAB, TOKENS, BLOCK, TAPS, MASK = 5120, 248_320, 3072, 16, 5, 248_070
LABELS = 32_768  # labels drawn from these ids: inside every vocabulary measured


def rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def flagship_drafter(layers: int, k: int):
    """A random flagship-width drafter (embedding and lm_head one tied fp32 tensor, to fit 24 GB),
    drafting from the first k ids when k < VOCAB."""
    import torch

    from harness.draft_vocab import with_draft_vocab
    from pipeline.drafter.model import DFlashDrafter, DrafterConfig
    from pipeline.drafter.vocab import DraftVocab

    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=HIDDEN, intermediate_size=17408, num_hidden_layers=layers, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, vocab_size=VOCAB, target_layer_ids=[1, 16, 31, 46, 61],
                           num_target_layers=64, mask_token_id=MASK, block_size=BLOCK, rope_theta=1e7)
    shared = torch.nn.Embedding(VOCAB, HIDDEN)
    shared.weight.data.normal_(0, 0.02)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, device="meta")
    head.weight = shared.weight
    drafter = DFlashDrafter(config, embed=shared, lm_head=head)
    return drafter if k >= VOCAB else with_draft_vocab(drafter, DraftVocab(torch.arange(k), VOCAB))


def one_step(k: int, layers: int, anchors: int) -> dict:
    """One micro-step in this process (the `one` child)."""
    import numpy as np
    import torch

    from pipeline.training.batch import final_hidden, pack, prepare
    from pipeline.training.loss import supervised_loss
    from pipeline.training.metrics import hit_sums

    drafter = flagship_drafter(layers, k)
    rng = np.random.default_rng(0)
    sample = {"input_ids": rng.integers(0, LABELS, TOKENS), "loss_mask": np.ones(TOKENS, np.uint8),
              "target_argmax": rng.integers(0, LABELS, TOKENS),
              "hidden": rng.standard_normal((TOKENS, TAPS, HIDDEN), dtype=np.float32)}
    seq = prepare(sample, block_size=BLOCK, num_anchors=anchors, max_length=TOKENS, mask_token_id=MASK, gamma=7.0,
                  generator=torch.Generator().manual_seed(0), vocab=drafter.draft_vocab)
    packed = pack([seq], BLOCK)
    del sample
    Path("/proc/self/clear_refs").write_text("5")
    before = rss_bytes("VmRSS")
    start = time.perf_counter()
    final = final_hidden(drafter, packed)
    loss, hits = supervised_loss(final, drafter.lm_head_weight, packed.labels, packed.weights, with_hits=True)
    loss.backward()
    hit_sums(hits, packed.weights, packed.real_blocks, packed.outside)
    seconds = time.perf_counter() - start
    return {"k": k, "layers": layers, "query_slots": anchors * BLOCK, "supervised_rows": int((packed.weights > 0).sum()),
            "step_s": round(seconds, 2), "step_peak_bytes": rss_bytes("VmHWM") - before, "threads": torch.get_num_threads()}


def one_floor(k: int, layers: int, anchors: int) -> dict:
    """The step's matrix-multiply floor at head size k, in this process (the `floor` child):
    GemmFloor's multiplies (benchmarks/training/peers_impls.py) for fc and the layers, and the head's two
    (forward, input gradient) on the supervised rows a chunk of rows at a time, as the loss runs
    them: one [rows, k] logits gradient whole is 7.6 GB at the full vocabulary, and its forward
    product as much again, more than this machine holds beside the head."""
    import torch

    from benchmarks.training.peers_impls import GemmFloor, Geometry
    from pipeline.training.loss import chunk_rows_for

    floor = GemmFloor(Geometry(hidden=HIDDEN, layers=layers, heads=32, kv_heads=8, head_dim=128, intermediate=17408,
                               vocab=1, taps=TAPS, tokens=TOKENS, anchors=anchors))
    floor.products = floor.products[:-2]  # GemmFloor's head pair, at vocabulary 1: replaced below
    rows, chunk = anchors * (BLOCK - 1), chunk_rows_for(k)
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(HIDDEN, k, generator=gen)
    x = torch.randn(rows, HIDDEN, generator=gen)
    dlogits = torch.randn(chunk, k, generator=gen)
    flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in floor.products) + 4 * rows * HIDDEN * k
    start = time.perf_counter()
    floor.step()
    for a in range(0, rows, chunk):
        n = min(chunk, rows - a)
        torch.mm(x[a:a + n], head)
        torch.mm(dlogits[:n], head.t())
    return {"floor_s": round(time.perf_counter() - start, 2), "floor_gflop": round(flops / 1e9)}


def section_step(args) -> dict:
    rows = []
    for k in args.ks:
        row = {}
        for what in ("one", "floor"):
            out = subprocess.run([sys.executable, __file__, what, "--k", str(k), "--layers", str(args.layers),
                                  "--anchors", str(args.anchors)], capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{what} --k {k}: exit {out.returncode}: {out.stderr.strip()[-500:]}")
            row.update(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(row), file=sys.stderr, flush=True)
        row["over_floor"] = round(row["step_s"] / row["floor_s"], 3)
        rows.append(row)
    full = next((r for r in rows if r["k"] == VOCAB), None)
    if full:
        for r in rows:
            r["time_vs_full"] = round(r["step_s"] / full["step_s"], 3)
            r["peak_vs_full"] = round(r["step_peak_bytes"] / full["step_peak_bytes"], 3)
            r["floor_vs_full"] = round(r["floor_s"] / full["floor_s"], 3)
    return {"section": "step", "rows": rows}


def section_drafting(args) -> dict:
    import torch

    from pipeline.drafter.attention_rule import suffix_attention

    rows = []
    for k in args.ks:
        drafter = flagship_drafter(args.layers, k).eval()
        c = drafter.config
        for batch in args.batches:
            context = 1024
            kv = {i: (torch.randn(batch, c.num_key_value_heads, context, c.head_dim),
                      torch.randn(batch, c.num_key_value_heads, context, c.head_dim)) for i in range(c.num_hidden_layers)}
            ids = torch.full((batch, BLOCK), MASK)
            ids[:, 0] = 7
            pos = torch.arange(context, context + BLOCK).expand(batch, BLOCK)

            @torch.no_grad()
            def step():
                states = drafter.block_states(ids, pos, lambda attn: kv[attn.layer], suffix_attention(pos), torch.float32)
                return drafter.target_logits(states[:, 1:]).argmax(-1)
            step()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            rows.append({"k": k, "batch": batch, "step_ms": round(1000 * statistics.median(times), 1)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del drafter
    for r in rows:
        full = next((f for f in rows if f["k"] == VOCAB and f["batch"] == r["batch"]), None)
        if full:
            r["time_vs_full"] = round(r["step_ms"] / full["step_ms"], 3)
    return {"section": "drafting", "rows": rows}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, capture_output=True, text=True, check=True)


def section_embedded(args) -> dict:
    from harness.runs import small_cache
    from pipeline.embedded import TRAIN_DATA
    from pipeline.records.eval_result import flat, variants_in

    work = Path(args.work)
    rows_in = [json.loads(line) for line in TRAIN_DATA.read_text().splitlines() if line.strip()][:400]
    cache = work / "cache"
    if not (cache / "manifest.json").is_file():
        small_cache(work, rows_in, 2)
    rows = []
    for k in [None, *args.ks]:
        run = work / f"run-{k or 'full'}"
        start = time.perf_counter()
        _cli("train", "--cache", str(cache), "--out", str(run), "--max-steps", str(args.steps), "--log-every", "10",
             "--seed", "0", *(["--draft-vocab", str(k)] if k else []))
        train_s = time.perf_counter() - start
        start = time.perf_counter()
        ev = json.loads(_cli("eval", "--drafter", str(run), "--limit", str(args.prompts), "--json").stdout)
        (work / f"eval-{k or 'full'}.json").write_text(json.dumps(ev, indent=2) + "\n")
        record = json.loads((run / "run.json").read_text())
        last = json.loads((run / "train_log.jsonl").read_text().splitlines()[-1])
        variants = variants_in(ev)
        rows.append({"k": k or "full", "coverage": (record.get("draft_vocab") or {}).get("coverage", 1.0),
                     "outside_vocab_last_log": last.get("outside_vocab", 0.0), "accuracy_last_log": last.get("accuracy"),
                     **flat(variants, "tau_pooled"),
                     "identical_to_greedy": {v.scalar: value.get("identical_to_greedy") for v, value in variants},
                     "prompts": ev["prompts"],
                     "train_s": round(train_s, 1), "eval_s": round(time.perf_counter() - start, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"section": "embedded", "steps": args.steps, "prompts": args.prompts, "rows": rows}


def section_coverage(args) -> dict:
    from harness.runs import write_rows
    from pipeline.cache.reader import open_cache
    from pipeline.config import ExtractConfig
    from pipeline.embedded import TRAIN_DATA
    from pipeline.target_model import load_tokenizer
    from pipeline.toy.random_target import build_random_target
    from pipeline.training.draft_vocab import count_labels, coverage, vocab_from_counts
    from stages.extract.run import run_extract

    fixtures = REPO.parent / "shared" / "fixtures"
    work = Path(args.work)
    target = work / "target"
    if not (target / "config.json").is_file():
        build_random_target(target, fixtures / "tokenizers" / "qwen3.6", fixtures / "chat_templates" / "qwen3.6.jinja")
    cache = work / "cache"
    if not (cache / "manifest.json").is_file():
        data = write_rows(work / "rows.jsonl", [json.loads(line) for line in TRAIN_DATA.read_text().splitlines()
                                                if line.strip()][:args.rows])
        run_extract(ExtractConfig(target=str(target), data=[str(data)], cache=str(cache), num_shards=4), None, progress=False)
    reader = open_cache(cache)
    shards = sorted(reader.shards)
    chosen_from, held_out = shards[:2], shards[2:]
    counts_a = count_labels(reader, VOCAB, 3072, chosen_from)
    counts_b = count_labels(reader, VOCAB, 3072, held_out)
    tokenizer = load_tokenizer(target)
    ids, kept = vocab_from_counts(counts_a, tokenizer, size=args.k, vocab_size=VOCAB, mask_id=MASK)
    return {"section": "coverage", "k": args.k, "rows": args.rows, "chosen_from": chosen_from, "held_out": held_out,
            "labels_chosen_from": int(counts_a.sum()), "labels_held_out": int(counts_b.sum()),
            "distinct_labels_chosen_from": int((counts_a > 0).sum()), "distinct_labels_held_out": int((counts_b > 0).sum()),
            "reserved": len(kept["reserved"]), "byte_fallbacks": len(kept["bytes"]),
            "coverage_on_chosen_from": round(coverage(counts_a, ids), 4),
            "coverage_on_held_out": round(coverage(counts_b, ids), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="section", required=True)
    parsers = {}
    for name in ("step", "one", "floor", "drafting"):
        s = parsers[name] = sub.add_parser(name)
        s.add_argument("--layers", type=int, default=1, help="Drafter layers (default 1).")
        s.add_argument("--anchors", type=int, default=512, help="Anchors of the one sequence (x block 16 query slots; default 512).")
        s.add_argument("--ks", default=f"{VOCAB},65536,32768", help="Head sizes K to measure, comma-separated (the full vocabulary first).")
        s.add_argument("--k", type=int, default=VOCAB, help="The head size of one child process (`one`, `floor`).")
        s.add_argument("--batches", default="1,8", help="drafting: prompts per step, comma-separated.")
        s.add_argument("--repeats", type=int, default=5, help="drafting: timed steps per setting (after one warm).")
    s = parsers["embedded"] = sub.add_parser("embedded")
    s.add_argument("--work", required=True, help="Folder for the cache, the runs and the eval results.")
    s.add_argument("--ks", default="128,256", help="Draft vocabulary sizes, comma-separated (the whole vocabulary is always run).")
    s.add_argument("--steps", type=int, default=250, help="Training steps of each run.")
    s.add_argument("--prompts", type=int, default=64, help="Held-out prompts evaluated.")
    s = parsers["coverage"] = sub.add_parser("coverage")
    s.add_argument("--work", required=True, help="Folder for the random target and its cache.")
    s.add_argument("--k", type=int, default=32_768, help="The vocabulary size (default 32,768).")
    s.add_argument("--rows", type=int, default=400, help="Embedded training conversations extracted.")
    args = p.parse_args()
    own = parsers[args.section]
    for name in ("ks", "batches"):
        if hasattr(args, name):
            setattr(args, name, positive_ints(own, f"--{name}", getattr(args, name)))
    at_least_one(own, args, *(n for n in ("layers", "anchors", "k", "repeats", "steps", "prompts", "rows") if hasattr(args, n)))
    if args.section in ("one", "floor"):
        print(json.dumps((one_step if args.section == "one" else one_floor)(args.k, args.layers, args.anchors)))
        return
    result = {"step": section_step, "drafting": section_drafting, "embedded": section_embedded,
              "coverage": section_coverage}[args.section](args)
    from pipeline.timing_machine import describe_machine
    result["machine"] = describe_machine()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
