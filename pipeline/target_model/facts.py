"""What a target model directory is: facts read from its config.json, never hard-coded (DESIGN 7),
and what it claims about a cache's identity.

Handles both the multimodal checkpoint layout (`model_type: qwen3_5`, text facts under
`text_config`) and a text-only one (`qwen3_5_text`). Reading facts costs one small JSON read;
loading weights is separate and explicit.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError


@dataclass(frozen=True, kw_only=True)
class TargetFacts:
    path: Path
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    layer_types: list[str]
    num_attention_heads: int
    num_key_value_heads: int
    config_sha256: str


def read_target_facts(path: str | Path) -> TargetFacts:
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        hint = ""
        if not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)):
            hint = (f"; it looks like a Hub id, and nothing is downloaded at run time: fetch it first "
                    f"(hf download {path} --local-dir DIR) and pass DIR")
        raise PipelineError(f"{path}: not a target model directory (no config.json){hint}")
    raw = config_file.read_bytes()
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise PipelineError(f"{config_file}: invalid JSON ({e})") from None
    text = config.get("text_config") or config
    try:
        num_layers = int(text["num_hidden_layers"])
        facts = TargetFacts(
            path=path,
            model_type=str(config.get("model_type", "")),
            num_hidden_layers=num_layers,
            hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]),
            layer_types=list(text.get("layer_types") or ["full_attention"] * num_layers),
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text.get("num_key_value_heads", text["num_attention_heads"])),
            config_sha256=hashlib.sha256(raw).hexdigest(),
        )
    except KeyError as e:
        raise PipelineError(f"{config_file}: missing field {e.args[0]!r}") from None
    if len(facts.layer_types) != num_layers:
        raise PipelineError(f"{config_file}: layer_types has {len(facts.layer_types)} entries for {num_layers} layers")
    return facts


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


def reserved_token_ids(tokenizer) -> set[int]:
    """The tokenizer's special and added tokens: ids that text never tokenizes to by accident, so
    the ones a cache contains are worth recording (a mask id must be one of them, or a row past
    the tokenizer's vocabulary)."""
    return set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())


def end_of_turn_ids(tokenizer, end_of_turn: str = "<|im_end|>") -> set[int]:
    """The ids that end a generated answer: the tokenizer's eos and the chat template's end of turn."""
    return {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(end_of_turn)) if isinstance(i, int)}


def chat_template_sha256(tokenizer) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()


def config_sha256(path: Path) -> str | None:
    """sha256 of a directory's config.json, None if it has none."""
    config = Path(path) / "config.json"
    return hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None


def identity_claims(target_dir: Path, *, tokenizer=None, weights: bool = False, config: bool = True) -> dict:
    """What a target directory says about the cache identity fields it decides (dotted paths of
    `pipeline.cache.identity.Identity`): compared with a cache to prove it is the target the cache
    was extracted with. `weights` hashes the weight files (or their headers, when large); `config`
    False leaves config.json's digest out (training needs the same weights, not the same bytes)."""
    from pipeline.provenance import tokenizer_digest, weight_digests  # heavy: imports torch

    facts = read_target_facts(target_dir)
    claims = {"target.config_sha256": facts.config_sha256, "capture.hidden_size": facts.hidden_size,
              "capture.vocab_size": facts.vocab_size, "capture.num_hidden_layers": facts.num_hidden_layers,
              "tokenizer.files_sha256": tokenizer_digest(target_dir)}
    if not config:
        del claims["target.config_sha256"]
    if tokenizer is not None:
        claims["tokenizer.chat_template_sha256"] = chat_template_sha256(tokenizer)
    if weights:
        claims["target.weights.files"] = weight_digests(target_dir)["files"]
    return claims
