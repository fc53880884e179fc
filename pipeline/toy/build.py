"""Build the embedded tiny target kit from a fixed seed.

    python -m pipeline.toy.build [--out DIR] [--seed 0] [--steps 280]

Writes, in standard Hugging Face layout:
    DIR/target/   config.json, model.safetensors, tokenizer files, chat template
    DIR/data/     train.jsonl (>= 1,000) and heldout.jsonl (>= 200) conversations whose
                  assistant turns were generated greedily by the trained target itself
    DIR/build.json  what was built, how long it took, how well the target predicts

Costs about 5 minutes on 2 CPU cores, almost all of it training. Seeds of the parts:
tokenizer corpus `seed`, training stream `seed + 1`, accuracy set `seed + 2`, dataset
prompts `seed + 3` (train) and `seed + 4` (held-out).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from pipeline.embedded import EMBEDDED_DIR
from pipeline.toy import chat, tasks
from pipeline.toy.generate import regenerate
from pipeline.toy.model import tiny_config
from pipeline.toy.tokenizer import train_tokenizer
from pipeline.toy.train import heldout_accuracy, train

NUM_MERGED_TOKENS = 240
NUM_TOKENIZER_CONVERSATIONS = 5000
NUM_ACCURACY_CONVERSATIONS = 500
NUM_TRAIN = 1000
NUM_HELDOUT = 200
# Prompts drawn beyond the target counts, so conversations the target fails to end can be dropped.
SPARE = 0.1


def build_tokenizer(seed: int):
    texts = [chat.render(c) for c in tasks.conversations(seed, NUM_TOKENIZER_CONVERSATIONS)]
    return train_tokenizer(texts, NUM_MERGED_TOKENS)


def build_model(tokenizer, *, seed: int, num_steps: int, log=print):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    model = Qwen3_5ForCausalLM(config)
    stats = train(model, tokenizer, seed=seed + 1, num_steps=num_steps, log=log)
    return model, stats


def build_dataset(model, tokenizer, *, seed: int, first: int | None = None) -> tuple[dict[str, list[dict]], dict]:
    """({split: rows}, stats); each row is {"id", "messages"} with target-generated assistant turns.
    stats: per split, how many conversations were dropped and how often the target's answer
    equals the task's ground truth (user turns are unchanged, so turn k answers the same prompt).
    `first`: regenerate only the first N drawn conversations of each split (a reproducibility
    check: its rows are the first rows of the full build's split); None builds the kit."""
    out, stats = {}, {}
    for split, split_seed, count in (("train", seed + 3, NUM_TRAIN), ("heldout", seed + 4, NUM_HELDOUT)):
        truth = tasks.conversations(split_seed, int(count * (1 + SPARE)))
        if first is not None and first < len(truth):
            truth = truth[:first]
            count = min(count, first)
        generated = regenerate(model, tokenizer, truth)
        pairs = [(t, g) for t, g in zip(truth, generated) if g is not None]
        if len(pairs) < count and first is None:
            raise RuntimeError(f"only {len(pairs)} of {len(truth)} {split} conversations ended; need {count}")
        pairs = pairs[:count]
        out[split] = [{"id": f"{split}-{i:05d}", "messages": g} for i, (_, g) in enumerate(pairs)]
        turns = [(a["content"], b["content"]) for t, g in pairs for a, b in zip(t, g) if a["role"] == "assistant"]
        stats[split] = {"dropped": len(truth) - sum(g is not None for g in generated),
                        "answers_equal_ground_truth": sum(a == b for a, b in turns) / len(turns)}
    return out, stats


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path, *, seed: int, num_steps: int, log=print) -> dict:
    import tokenizers
    import transformers

    t0 = time.perf_counter()
    tokenizer = build_tokenizer(seed)
    t_tok = time.perf_counter()
    log(f"tokenizer: {len(tokenizer)} tokens ({t_tok - t0:.1f}s)")
    model, train_stats = build_model(tokenizer, seed=seed, num_steps=num_steps, log=log)
    t_train = time.perf_counter()
    accuracy = heldout_accuracy(model, tokenizer, tasks.conversations(seed + 2, NUM_ACCURACY_CONVERSATIONS))
    log(f"held-out assistant-token accuracy: {accuracy['accuracy']:.4f}")
    t_eval = time.perf_counter()
    dataset, dataset_stats = build_dataset(model, tokenizer, seed=seed)
    t_data = time.perf_counter()

    # Build in a scratch folder beside the destination, then swap it in: a failed build never
    # leaves a half-written kit where the package looks for it.
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    model.save_pretrained(scratch / "target")
    tokenizer.save_pretrained(scratch / "target")
    (scratch / "data").mkdir()
    for split, rows in dataset.items():
        write_jsonl(scratch / "data" / f"{split}.jsonl", rows)
    files = sorted(p for p in scratch.rglob("*") if p.is_file())
    report = {
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": {k: getattr(model.config, k) for k in (
            "num_hidden_layers", "hidden_size", "vocab_size", "layer_types",
            "num_attention_heads", "num_key_value_heads")},
        "tokenizer_size": len(tokenizer),
        "train": train_stats,
        "heldout_accuracy": accuracy,
        "dataset": {split: len(rows) for split, rows in dataset.items()},
        "dataset_stats": dataset_stats,
        "seconds": {"tokenizer": t_tok - t0, "train": t_train - t_tok, "accuracy": t_eval - t_train,
                    "dataset": t_data - t_eval, "total": time.perf_counter() - t0},
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "files": {str(p.relative_to(scratch)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files},
    }
    (scratch / "build.json").write_text(json.dumps(report, indent=2) + "\n")
    for name in ("target", "data", "build.json"):
        dest = out / name
        if dest.is_dir():
            shutil.rmtree(dest)
        elif dest.exists():
            dest.unlink()
        out.mkdir(parents=True, exist_ok=True)
        os.replace(scratch / name, dest)
    shutil.rmtree(scratch)
    log(f"built {out} in {report['seconds']['total']:.0f}s")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=EMBEDDED_DIR, help="destination (default: the package's embedded dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=280, help="training steps of 32 conversations")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # the torch-fallback notice is expected here
    build(args.out, seed=args.seed, num_steps=args.steps)


if __name__ == "__main__":
    main()
