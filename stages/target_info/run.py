"""`pipeline target-info`: a summary of a target and its conversation data.

Loads the model and tokenizer the way every stage will (transformers, offline), reads its facts
from config.json, and runs one real check: the target, teacher-forced on held-out conversations
it generated itself, should predict its own assistant tokens (agreement near 1.0). Costs a few
seconds on the tiny target.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.data.conversations import iter_rows
from pipeline.target_model import chat_template_sha256, load_target, load_tokenizer, read_target_facts
from pipeline.data.self_agreement import self_agreement
from pipeline.target_model.taps import default_taps


def layer_pattern(layer_types: list[str]) -> str:
    """A target's layer pattern in a few words, for people: ['linear_attention'] * 3 +
    ['full_attention'] -> 'linear x3, full'."""
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
    tokenizer = load_tokenizer(target_dir)  # a directory without tokenizer files fails before the weights load
    model = load_target(target_dir)
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
        rows = list(iter_rows([heldout]))
        summary["heldout_conversations"] = len(rows)
        summary["self_agreement"] = self_agreement(model, tokenizer, rows[:num_check],
                                                   tokenizer.eos_token)
    return summary
