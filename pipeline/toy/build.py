"""Build the embedded tiny target kit from a fixed seed.

    python -m pipeline.toy.build [--out DIR] [--seed 0] [--steps 900] [--dataset-only [--from DIR]]

Writes, in standard Hugging Face layout:
    DIR/target/   config.json, model.safetensors, tokenizer files, chat template
    DIR/data/     train.jsonl (1,000) and heldout.jsonl (200) conversations whose assistant
                  turns were generated greedily by the trained target itself (thinking mode,
                  tools and tool replies as pipeline/toy/tasks.py draws them)
    DIR/build.json  what was built, how long it took, how well the target predicts, the
                  dataset's shares of each kind of conversation

Costs about 14 minutes on 2 CPU cores, 11 of them training (900 steps of about 2,560 padded
tokens; 600 steps gave a target that could not end a count, so a third of the regenerated
conversations never ended; see pipeline/toy/train.py). Over the old kit's 5 minutes: the tool
schemas triple a row's length, and Gated DeltaNet heads of dim 64 cost more per step than 32.
`--dataset-only` regenerates the data (and build.json) with the kit's own target (3 minutes).
Seeds of the parts:
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
from pipeline.timing_machine import describe_machine
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
NUM_STEPS = 900
# Prompts drawn beyond the target counts, so conversations the target fails to end can be dropped.
SPARE = 0.3


def build_tokenizer(seed: int):
    texts = [chat.render(c.messages, tools=c.tools, **c.template_kwargs)
             for c in tasks.conversations(seed, NUM_TOKENIZER_CONVERSATIONS)]
    return train_tokenizer(texts, NUM_MERGED_TOKENS)


def build_model(tokenizer, *, seed: int, num_steps: int, log=print):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    model = Qwen3_5ForCausalLM(config)
    stats = train(model, tokenizer, seed=seed + 1, num_steps=num_steps, log=log)
    return model, stats


def build_dataset(model, tokenizer, *, seed: int, first: int | None = None, log=print) -> tuple[dict[str, list[dict]], dict]:
    """({split: rows}, stats); each row is {"id", "messages", "chat_template_kwargs", "tools"?} with
    target-generated assistant turns. stats: per split, the shares of each kind of conversation,
    how many were dropped and why, and how often the target's tool use and final answers equal the
    ground truth's (user turns are unchanged, so turn k answers the same prompt).
    `first`: regenerate only the first N drawn conversations of each split (a reproducibility
    check: its rows are the first rows of the full build's split); None builds the kit."""
    out, stats = {}, {}
    for split, split_seed, count in (("train", seed + 3, NUM_TRAIN), ("heldout", seed + 4, NUM_HELDOUT)):
        truth = tasks.conversations(split_seed, int(count * (1 + SPARE)))
        if first is not None and first < len(truth):
            truth = truth[:first]
            count = min(count, first)
        generated, why, examples = regenerate(model, tokenizer, truth)
        for reason, text in examples.items():
            log(f"{split}: {why[reason]} dropped, {reason}; the first: {text!r}")
        pairs = [(t, g) for t, g in zip(truth, generated) if g is not None]
        if len(pairs) < count and first is None:
            raise RuntimeError(f"only {len(pairs)} of {len(truth)} {split} conversations kept ({dict(why)}); need {count}")
        pairs = pairs[:count]
        out[split] = [g.row(f"{split}-{i:05d}") for i, (_, g) in enumerate(pairs)]
        stats[split] = {"drawn": len(truth), "dropped": sum(why.values()),
                        "dropped_why": dict(sorted(why.items())), **shares([g for _, g in pairs]),
                        **agreement(pairs)}
    return out, stats


def shares(conversations: list[tasks.Conversation]) -> dict:
    """What the rows hold, as fractions of the rows."""
    n = len(conversations)
    if not n:
        return {"rows": 0}

    def share(test) -> float:
        return round(sum(bool(test(c)) for c in conversations) / n, 4)

    def ends_at_call(c) -> bool:
        return bool(c.messages[-1].get("tool_calls"))

    return {"rows": n,
            "thinking": share(lambda c: c.thinking),
            "tools_given": share(lambda c: c.tools),
            "tool_called": share(lambda c: any(m.get("tool_calls") for m in c.messages)),
            "ends_at_pending_call": share(ends_at_call),
            "multi_turn": share(lambda c: sum(m["role"] == "user" for m in c.messages) > 1),
            "last_turn": {"thinking": share(lambda c: not ends_at_call(c) and c.thinking),
                          "non_thinking": share(lambda c: not ends_at_call(c) and not c.thinking),
                          "tool_call": share(ends_at_call)}}


def per_user_turn(messages: list[dict]) -> list[tuple[list, str]]:
    """For each user turn: (the tool calls made answering it, the last answer's content)."""
    turns: list[tuple[list, str]] = []
    for m in messages:
        if m["role"] == "user":
            turns.append(([], ""))
        elif m["role"] == "assistant" and turns:
            calls, _ = turns[-1]
            turns[-1] = (calls + [c["function"] for c in m.get("tool_calls") or []], m.get("content") or "")
    return turns


def agreement(pairs) -> dict:
    same_tools = same_answer = total = 0
    for truth, generated in pairs:
        for (t_calls, t_text), (g_calls, g_text) in zip(per_user_turn(truth.messages), per_user_turn(generated.messages)):
            total += 1
            same_tools += t_calls == g_calls
            same_answer += t_text == g_text
    total = max(total, 1)
    return {"tool_use_equal_ground_truth": round(same_tools / total, 4),
            "answers_equal_ground_truth": round(same_answer / total, 4)}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One row a line, keys sorted for stable files, except in the tool schemas: the template
    renders a schema's keys in their order, and OpenAI-compatible servers (vLLM) re-serialise
    `tools` as type, function: name, description, parameters. The schemas keep the order the
    target saw in training (tasks.TOOL_SCHEMAS, which is that order), so a row's prompt renders
    to the same tokens in-process and through a server."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(_sorted_but_tools(row), ensure_ascii=False) + "\n")


def _sorted_but_tools(value, key: str | None = None):
    if key == "tools":
        return value
    if isinstance(value, dict):
        return {k: _sorted_but_tools(value[k], k) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_but_tools(v) for v in value]
    return value


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path, *, seed: int, num_steps: int, dataset_only: bool = False, source: Path | None = None,
          log=print) -> dict:
    """Build the kit into `out`; `dataset_only`: regenerate the data with the target of `source`
    (default `out`), whose build.json gives the seed and the training record."""
    import tokenizers
    import transformers

    t0 = time.perf_counter()
    # Build in a scratch folder beside the destination, then swap it in: a failed build never
    # leaves a half-written kit where the package looks for it. The trained target is saved there
    # before the dataset is generated, so a failing dataset step keeps it (--dataset-only --from).
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    if dataset_only:
        from transformers import AutoTokenizer, Qwen3_5ForCausalLM

        source = Path(source or out)
        previous = json.loads((source / "build.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(source / "target")
        model = Qwen3_5ForCausalLM.from_pretrained(source / "target", dtype=torch.float32, use_kernels=False).eval()
        seed, train_stats, accuracy = previous["seed"], previous["train"], previous["heldout_accuracy"]
        shutil.copytree(source / "target", scratch / "target")
        t_tok = t_train = t_eval = time.perf_counter()
    else:
        tokenizer = build_tokenizer(seed)
        t_tok = time.perf_counter()
        log(f"tokenizer: {len(tokenizer)} tokens ({t_tok - t0:.1f}s)")
        model, train_stats = build_model(tokenizer, seed=seed, num_steps=num_steps, log=log)
        t_train = time.perf_counter()
        accuracy = heldout_accuracy(model, tokenizer, tasks.conversations(seed + 2, NUM_ACCURACY_CONVERSATIONS))
        log(f"held-out assistant-token accuracy: {accuracy['accuracy']:.4f} {accuracy['by_kind']}")
        t_eval = time.perf_counter()
        model.save_pretrained(scratch / "target")
        tokenizer.save_pretrained(scratch / "target")
        (scratch / "build.json").write_text(json.dumps({"seed": seed, "train": train_stats, "heldout_accuracy": accuracy,
                                                        "seconds": {"train": t_train - t_tok}}) + "\n")
    try:
        dataset, dataset_stats = build_dataset(model, tokenizer, seed=seed, log=log)
    except Exception:
        log(f"the dataset step failed; the trained target is kept in {scratch} (--dataset-only --from {scratch})")
        raise
    t_data = time.perf_counter()
    log(f"dataset: {json.dumps(dataset_stats)}")
    (scratch / "data").mkdir()
    for split, rows in dataset.items():
        write_jsonl(scratch / "data" / f"{split}.jsonl", rows)
    files = sorted(p for p in scratch.rglob("*") if p.is_file() and p.name != "build.json")
    report = {
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": {k: getattr(model.config, k) for k in (
            "num_hidden_layers", "hidden_size", "vocab_size", "layer_types",
            "num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim")},
        "tasks": {"plain": sorted(tasks.TASKS), "with_a_tool": sorted(tasks.TOOL_TASKS),
                  "shares": {"thinking": tasks.THINKING, "tools": tasks.TOOLS, "tool_task": tasks.TOOL_TASK,
                             "pending_call": tasks.PENDING_CALL}},
        "tokenizer_size": len(tokenizer),
        "train": train_stats,
        "heldout_accuracy": accuracy,
        "dataset": {split: len(rows) for split, rows in dataset.items()},
        "dataset_stats": dataset_stats,
        "seconds": {**previous["seconds"], "dataset": t_data - t_eval,
                    "total": previous["seconds"].get("total", 0) - previous["seconds"].get("dataset", 0) + t_data - t_eval}
        if dataset_only else {
            "tokenizer": t_tok - t0, "train": t_train - t_tok, "accuracy": t_eval - t_train,
            "dataset": t_data - t_eval, "total": time.perf_counter() - t0},
        "machine": {**describe_machine(), "python": platform.python_version()},
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
    log(f"built {out} in {time.perf_counter() - t0:.0f}s")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=EMBEDDED_DIR, help="destination (default: the package's embedded dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=NUM_STEPS, help="training steps (of about 2,560 padded tokens)")
    parser.add_argument("--dataset-only", action="store_true", help="regenerate the data with the kit's own target")
    parser.add_argument("--from", dest="source", type=Path, help="with --dataset-only: the kit (or kept build) to take the target from")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # the torch-fallback notice is expected here
    build(args.out, seed=args.seed, num_steps=args.steps, dataset_only=args.dataset_only, source=args.source)


if __name__ == "__main__":
    main()
