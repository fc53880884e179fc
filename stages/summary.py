"""Summary of a target and its conversation data: what `pipeline demo` prints on the embedded default.

Loads the model and tokenizer the way every stage will (transformers, offline), reads its facts
from config.json, and runs one real check: the target, teacher-forced on held-out conversations
it generated itself, should predict its own assistant tokens (agreement near 1.0). Costs a few
seconds on the tiny target.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from pipeline.errors import PipelineError
from pipeline.taps import default_taps
from pipeline.target import chat_template_sha256, load_model, load_tokenizer, read_target_facts


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise PipelineError(f"{path}:{line_no}: invalid JSON ({e.msg})") from None
    return rows


def load_target(path: Path):
    """(model, tokenizer) from a local directory, float32, eval mode, nothing downloaded."""
    tokenizer = load_tokenizer(path)
    return load_model(path), tokenizer


@torch.no_grad()
def self_agreement(model, tokenizer, conversations: list[list[dict]], end_of_turn: str) -> dict:
    """Share of supervised tokens the target predicts itself (teacher-forced top-1)."""
    from pipeline.data.loss_mask import tokenize_conversation

    same = total = 0
    start = time.perf_counter()
    num_tokens = 0
    for messages in conversations:
        sample = tokenize_conversation(tokenizer, messages, end_of_turn)
        ids = torch.tensor([sample.input_ids])
        predicted = model(input_ids=ids).logits[0, :-1].argmax(-1)
        mask = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
        same += (predicted == ids[0, 1:])[mask].sum().item()
        total += int(mask.sum())
        num_tokens += ids.shape[1]
    seconds = time.perf_counter() - start
    return {"agreement": same / max(total, 1), "supervised_tokens": total, "conversations": len(conversations),
            "forward_tokens_per_s": num_tokens / seconds}


def layer_pattern(layer_types: list[str]) -> str:
    """['linear_attention'] * 3 + ['full_attention'] -> 'linear x3, full'."""
    runs: list[list] = []
    for kind in layer_types:
        short = kind.removesuffix("_attention")
        if runs and runs[-1][0] == short:
            runs[-1][1] += 1
        else:
            runs.append([short, 1])
    return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in runs)


def target_summary(target_dir: Path, *, heldout: Path | None = None, build_report: Path | None = None,
                   num_check: int = 16, num_taps: int = 3) -> dict:
    facts = read_target_facts(target_dir)
    model, tokenizer = load_target(target_dir)
    mask_token = "<|MASK|>"
    summary = {
        "target_dir": str(target_dir),
        "class": type(model).__name__,
        "model_type": facts.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "num_hidden_layers": facts.num_hidden_layers,
        "layer_types": layer_pattern(facts.layer_types),
        "hidden_size": facts.hidden_size,
        "vocab_size": facts.vocab_size,
        "tokenizer_size": len(tokenizer),
        "heads": {"q": facts.num_attention_heads, "kv": facts.num_key_value_heads},
        f"default_taps_{num_taps}": default_taps(facts.num_hidden_layers, num_taps),
        "mask_token_id": tokenizer.convert_tokens_to_ids(mask_token) if mask_token in tokenizer.get_vocab() else None,
        "end_of_turn": tokenizer.eos_token,
        "chat_template_sha256": chat_template_sha256(tokenizer),
    }
    if build_report is not None and build_report.is_file():
        report = json.loads(build_report.read_text())
        summary["build"] = {"seed": report["seed"], "heldout_accuracy": report["heldout_accuracy"]["accuracy"],
                            "train_seconds": round(report["seconds"]["train"], 1), "dataset": report["dataset"]}
    if heldout is not None:
        rows = read_jsonl(heldout)
        summary["heldout_conversations"] = len(rows)
        summary["self_agreement"] = self_agreement(model, tokenizer, [r["messages"] for r in rows[:num_check]],
                                                   tokenizer.eos_token)
    return summary
