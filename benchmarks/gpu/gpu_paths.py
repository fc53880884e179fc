"""The pipeline's GPU paths for benchmarks/gpu/gpu_check.py: extract, the linear-attention kernels
against transformers' torch reference, eval greedy and sampled, generate. Each section returns a
dict; gpu_check.py runs them in order, one process, and turns a failure into one line.

On a GPU node they run on the GPU (bf16 where the pipeline chooses it); `--smoke` runs the same
code at toy sizes on the CPU, where the kernels section compares the torch path with itself, says
that fla is not there and skips the per-op comparison.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch

from pipeline import embedded
from pipeline.cache.reader import CacheReader
from pipeline.config import ExtractConfig
from pipeline.target_model import load_target, load_tokenizer
from pipeline.target_model.internals import KernelCallCounter, bound_kernels, modeling_module_of, torch_fallback
from pipeline.target_model.taps import default_taps
from pipeline.toy.random_target import flagship_config
from stages.eval.options import EvalOptions
from stages.eval.run import run_eval
from stages.extract.run import run_extract
from stages.generate.options import GenerateOptions
from stages.generate.run import run_generate
from stages.train.run import resolve_config, run_train

# Sizes: (smoke on a CPU, a GPU node).
ROWS = {"smoke": 12, "gpu": 400}            # training conversations extracted, then trained on
TRAIN = {"smoke": {"max_steps": 4, "batch_sequences": 2, "num_anchors": 32},   # the code path, not a drafter
         "gpu": {"max_steps": 250}}                 # the tiny preset's drafter (the suite's shared drafter: 250)
EVAL = {"smoke": dict(limit=2, max_new_tokens=8), "gpu": dict(limit=32, max_new_tokens=96)}
FLAGSHIP_LAYERS = 4                         # linear x3 + full: one period of Qwen3.6-27B's layout
AGREEMENT_TOKENS = {"smoke": 96, "gpu": 2048}


def peak(device: torch.device) -> dict:
    """Peak memory since the last `reset_peak`: the GPU's allocator, or the process's RSS on a CPU
    (monotone over the process: an upper bound per section)."""
    if device.type == "cuda":
        return {"peak_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)}
    return {"peak_rss_GiB_process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _rows(n: int) -> list[dict]:
    return [json.loads(line) for line in Path(embedded.TRAIN_DATA).read_text().splitlines()[:n]]


def extract_embedded(device: torch.device, size: str, work: Path) -> dict:
    """`pipeline extract` of the embedded target (what a user's first extract does), with the
    kernel provenance the cache records."""
    data = work / "convs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(ROWS[size])))
    summary = run_extract(ExtractConfig(cache=str(work / "cache"), data=[str(data)], num_shards=2), None, progress=False)
    shards = CacheReader(work / "cache").manifest.shards
    kernels = {name: shard.kernel_path for name, shard in shards.items()}
    return {"tokens": summary["tokens"], "tokens_per_s": round(summary["tokens_per_s"], 1),
            "bytes_per_token": round(summary["bytes_per_token"], 1), "kernel_path_per_shard": kernels}


def _agreement(model, ids: torch.Tensor, taps: list[int]) -> dict:
    """The bound kernels against the torch reference on one forward: taps and logits."""
    with torch.no_grad(), KernelCallCounter(model) as counter:
        bound = model(input_ids=ids, output_hidden_states=True)
    with torch.no_grad(), torch_fallback(model):
        reference = model(input_ids=ids, output_hidden_states=True)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))

    return {"bound": {op: info["kind"] for op, info in bound_kernels(modeling_module_of(model)).items()},
            "calls": counter.counts,
            "tap_rel_diff": {str(t): round(rel(bound.hidden_states[t + 1], reference.hidden_states[t + 1]), 6) for t in taps},
            "logits_rel_diff": round(rel(bound.logits, reference.logits), 6),
            "argmax_agreement": round(float((bound.logits.argmax(-1) == reference.logits.argmax(-1)).float().mean()), 4)}


def kernels(device: torch.device, size: str) -> dict:
    """fla + causal-conv1d (as transformers bound them) against the torch fallback: the embedded
    target, and a random target at Qwen3.6-27B's widths with one period of its layers."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = AGREEMENT_TOKENS[size]
    generator = torch.Generator().manual_seed(0)
    tiny = load_target(embedded.TARGET_DIR, dtype=dtype).to(device)
    ids = torch.randint(0, tiny.config.vocab_size - 8, (1, n), generator=generator).to(device)
    out = {"ops": ops(device), "embedded": _agreement(tiny, ids, default_taps(tiny.config.num_hidden_layers, 3))}
    del tiny
    if size == "smoke":
        return {**out, "flagship_width": "skipped under --smoke (11 GB of weights at 4 layers)"}
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    fields = flagship_config(FLAGSHIP_LAYERS)
    config = Qwen3_5TextConfig(**{k: v for k, v in fields.items() if k != "torch_dtype"})
    torch.manual_seed(0)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            wide = Qwen3_5ForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(previous)
    ids = torch.randint(0, config.vocab_size - 8, (1, n), generator=generator).to(device)
    out["flagship_width"] = {"layers": FLAGSHIP_LAYERS, "tokens": n, **_agreement(wide, ids, [0, 1, 2])}
    return out


def ops(device: torch.device) -> dict | str:
    """fla's kernels op by op against transformers' torch functions on the same inputs (the pairs
    the CPU kernel tier asserts on under Triton's interpreter, harness/kernel_ops.py): the chunked
    and fused recurrent gated delta rule with initial and final states, fla's causal conv and its
    one-token update; max abs difference per output, fp32 inputs (the kernels' exactness: the tier
    measured 1e-7..1e-6) and bf16 (what extract runs on a GPU)."""
    if device.type != "cuda":
        return "skipped: needs fla on a GPU (on a CPU: TRITON_INTERPRET=1 pytest tests/kernels, README)"
    try:
        from harness.kernel_ops import all_pairs
        import fla  # noqa: F401
    except ImportError as e:
        return f"fla not installed ({e})"
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        out[str(dtype).removeprefix("torch.")] = {pair.op: pair.max_abs_diff() for pair in all_pairs(device, dtype)}
    return out


def train_and_eval(device: torch.device, size: str, work: Path) -> dict:
    """The tiny preset's drafter trained on the extracted cache, then `pipeline eval` greedy and
    sampled (block and DDTree 16): lossless, tau, speed against plain decoding."""
    cfg, preset_target = resolve_config(None, {"cache": str(work / "cache"), "out": str(work / "run"),
                                               "log_every": 10, **TRAIN[size]})
    start = time.perf_counter()
    trained = run_train(cfg, preset_target=preset_target, warn=lambda *_: None)
    out = {"train": {"steps": trained["steps"], "wall_s": round(time.perf_counter() - start, 1), "device": trained["device"],
                     "autocast": trained["autocast"], "loss": trained["last"]["loss"]}}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        result = run_eval(EvalOptions(drafter=work / "run", target=None, prompts=None, block_size=None,
                                      tree_budget=[16], tree_top_k=8, temperature=temperature,
                                      top_p=0.95 if temperature else 1.0, **EVAL[size]))
        reference = result["plain_sampling" if temperature else "greedy"]["tokens_per_s"]
        out[name] = {"device": result["device"], "lossless": result["lossless"], "reference_tokens_per_s": round(reference, 1),
                     **{v: {"tau": round(result[k]["tau_pooled"], 3) if v == "block" else round(result[k]["16"]["tau_pooled"], 3),
                            "speedup_vs_plain": round((result[k] if v == "block" else result[k]["16"])["tokens_per_s"] / reference, 3)}
                        for v, k in (("block", "block"), ("ddtree16", "tree"))}}
    return out


def generate(device: torch.device, size: str, work: Path) -> dict:
    """`pipeline generate` in-process on the device: the target regenerating the last turns."""
    data = work / "gen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(4 if size == "smoke" else 64)))
    start = time.perf_counter()
    summary = run_generate(GenerateOptions(data=[str(data)], out=work / "generated.jsonl", turns="last",
                                           max_new_tokens=16 if size == "smoke" else 256,
                                           temperature=1.0, top_p=0.95,
                                           batch_size=4 if size == "smoke" else 64))
    tokenizer = load_tokenizer(embedded.TARGET_DIR)
    rows = [json.loads(line) for line in (work / "generated.jsonl").read_text().splitlines()]
    # A row whose last turn did not end within max_new_tokens is left out of the output (generate's rule).
    return {"rows": summary["num_rows"], "rows_written": len(rows), "wall_s": round(time.perf_counter() - start, 1),
            "example": json.dumps(rows[0]["messages"][-1])[:160] if rows else None,
            "tokenizer_vocab": len(tokenizer)}
