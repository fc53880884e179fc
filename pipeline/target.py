"""What a target model directory is: facts read from its config.json, never hard-coded (DESIGN 7).

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


def chat_template_sha256(tokenizer) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()


def config_sha256(path: Path) -> str | None:
    """sha256 of a directory's config.json, None if it has none."""
    config = Path(path) / "config.json"
    return hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None


# --------------------------------------------------------------------------- which target


@dataclass(frozen=True)
class RecordedTarget:
    """The target a cache or a training run recorded: where it was and which config it had."""
    path: str | None
    config_sha256: str | None
    source: str  # what recorded it, for messages ("the cache manifest", "RUN/run.json")


def resolve_target(option: str | Path | None, recorded: RecordedTarget | None = None) -> Path:
    """The one place that decides which target directory a command uses:
    1. the option (--target DIR, or "embedded"), which must be a model directory;
    2. else the directory recorded by the cache or run, if its config.json is the recorded one;
    3. else, if the recorded directory is gone, the embedded target when it is the recorded model by
       config digest (a moved install).
    Never a different model: anything else is one error naming what was recorded."""
    from pipeline.config import EMBEDDED
    from pipeline.embedded import TARGET_DIR

    if option:
        path = TARGET_DIR if str(option) == EMBEDDED else Path(option)
        read_target_facts(path)  # a clear error if it is not a model directory
        return path
    if recorded is None or (recorded.path is None and recorded.config_sha256 is None):
        raise PipelineError("no target given and none recorded: pass --target DIR")
    at_recorded = Path(recorded.path) if recorded.path else None
    found = config_sha256(at_recorded) if at_recorded else None
    if found is not None and recorded.config_sha256 in (None, found):
        return at_recorded
    if found is None and recorded.config_sha256 is not None and config_sha256(TARGET_DIR) == recorded.config_sha256:
        return TARGET_DIR
    state = "is not there" if found is None else "is not the recorded model (its config.json differs)"
    raise PipelineError(f"the target recorded in {recorded.source} ({recorded.path}) {state}; pass --target DIR")


def identity_claims(target_dir: Path, *, tokenizer=None, weights: bool = False, config: bool = True) -> dict:
    """What a target directory says about the cache identity fields it decides (dotted paths of
    `pipeline.cache.manifest.Identity`): compared with a cache to prove it is the target the cache
    was extracted with. `weights` hashes the weight files (or their headers, when large); `config`
    False leaves config.json's digest out (training needs the same weights, not the same bytes)."""
    from pipeline.provenance import tokenizer_digest, weight_digests

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


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the "falling back to torch" notice is recorded, not printed
    hf_logging.disable_progress_bar()


def load_tokenizer(path: Path):
    """The target's tokenizer from a local directory; nothing is downloaded."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    if not (path / "config.json").is_file():
        raise PipelineError(f"{path}: not a target model directory (no config.json)")
    # Without its files AutoTokenizer can still build an empty tokenizer from the config, and
    # every conversation would then silently tokenize to nothing: refuse up front.
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise PipelineError(f"{path}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)}) in the target directory")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise PipelineError(f"{path}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None


def load_model(path: Path, *, dtype=None, **kwargs):
    """The target model from a local directory (float32 unless told), eval mode; nothing downloaded."""
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    if not list(path.glob("*.safetensors")) + list(path.glob("*.bin")):
        raise PipelineError(f"{path}: no weight files (*.safetensors) in the target directory")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype or torch.float32, **kwargs)
    except OSError as e:
        raise PipelineError(f"{path}: cannot load the target ({str(e).splitlines()[0]})") from None
    return model.eval()
