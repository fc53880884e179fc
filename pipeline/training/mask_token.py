"""The drafter's mask token (DESIGN 2): an id or a token of the target's tokenizer, which must be
a reserved token or a row past the tokenizer's vocabulary, and never occur in the cache's
input_ids; and the hint the refusal gives when the tokenizer has no such token."""

from __future__ import annotations

from pathlib import Path

from presets import load_preset, preset_names
from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import INPUT_IDS
from pipeline.errors import PipelineError
from pipeline.target_model import TargetFacts, load_tokenizer, reserved_token_ids


def mask_token_id(mask_token: str | int, target_dir: Path, facts: TargetFacts) -> int:
    """The mask id (DESIGN 2): an integer id, or a token string looked up in the target's
    tokenizer; it must have an embedding row and be a reserved token (special or added) or a row
    past the tokenizer's vocabulary, never an ordinary token that text produces."""
    return resolve_mask_token(mask_token, target_dir, facts)[0]


def resolve_mask_token(mask_token: str | int, target_dir: Path, facts: TargetFacts) -> tuple[int, str | None]:
    """(the mask id, checked as `mask_token_id` says; the token as the target's tokenizer spells
    it, which SGLang looks the id up by, or None for a row past the tokenizer's vocabulary)."""
    tokenizer = load_tokenizer(target_dir)
    mask_id = _checked_mask_id(mask_token, tokenizer, target_dir, facts)
    return mask_id, tokenizer.convert_ids_to_tokens(mask_id) if mask_id < len(tokenizer) else None


def _checked_mask_id(mask_token: str | int, tokenizer, target_dir: Path, facts: TargetFacts) -> int:
    if isinstance(mask_token, str):
        if mask_token not in tokenizer.get_vocab():
            raise PipelineError(f"{target_dir}: the tokenizer has no mask token {mask_token!r}: pass --mask-token ID|TOKEN "
                                f"(or mask_token in the [train.drafter] table of --config){suggest_mask_token(tokenizer, facts)}")
        mask_id = int(tokenizer.convert_tokens_to_ids(mask_token))
    else:
        mask_id = int(mask_token)
    if not 0 <= mask_id < facts.vocab_size:
        raise PipelineError(f"{target_dir}: mask token {mask_token!r} id {mask_id} has no embedding row "
                            f"(vocab_size {facts.vocab_size})")
    if mask_id < len(tokenizer) and mask_id not in reserved_token_ids(tokenizer):
        raise PipelineError(f"mask token id {mask_id} ({tokenizer.convert_ids_to_tokens(mask_id)!r}) is an ordinary token "
                            f"of the tokenizer: use a reserved special token or an unused row past its {len(tokenizer)} tokens")
    return mask_id


def suggest_mask_token(tokenizer, facts: TargetFacts) -> str:
    """A hint for the missing-mask-token error: a preset's mask id where this tokenizer reserves it
    (Qwen3.6: 248070, the reference drafters'), else the first reserved special token that the chat
    template never writes, else the first embedding row past the tokenizer's vocabulary."""
    used = {tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id}
    template = tokenizer.chat_template or ""
    unused = sorted(i for i in reserved_token_ids(tokenizer)
                    if i not in used and tokenizer.convert_ids_to_tokens(i) not in template and i < facts.vocab_size)
    for name in preset_names():
        target = load_preset(name).get("target", {})
        if target.get("vocab_size") == facts.vocab_size and target.get("mask_token") in unused:
            mask_id = target["mask_token"]
            return (f"; e.g. --mask-token {mask_id} ({tokenizer.convert_ids_to_tokens(mask_id)!r}, a reserved token the chat "
                    f"template never writes: the reference drafters' mask id, preset {name})")
    if unused:
        return (f"; e.g. --mask-token {unused[0]} ({tokenizer.convert_ids_to_tokens(unused[0])!r}, a reserved token the "
                "chat template never writes)")
    if len(tokenizer) < facts.vocab_size:
        return f"; e.g. --mask-token {len(tokenizer)} (an embedding row past the tokenizer's {len(tokenizer)} tokens)"
    return ""


def check_mask_absent(reader: CacheReader, mask_id: int) -> None:
    """Refuse a mask id that occurs in the cache's input_ids (the drafter could not tell a masked
    slot from that token). Extract records the reserved ids each shard contains; a shard without
    that record (written before it existed) has its input_ids read."""
    found = []
    for name in reader.shards:
        seen = (reader.manifest.shards[name].counts or {}).get("special_ids")
        if seen is not None:
            hit = mask_id in seen
        else:
            shard = reader.shard(name)
            step = 1 << 24
            hit = any(bool((shard.read_range(INPUT_IDS, a, min(a + step, shard.num_tokens)) == mask_id).any())
                      for a in range(0, shard.num_tokens, step))
        if hit:
            found.append(name)
    if found:
        raise PipelineError(f"mask token id {mask_id} occurs in the cache's input_ids ({', '.join(found[:4])}"
                            f"{' and more' if len(found) > 4 else ''}): the drafter could not tell a masked slot from "
                            "that token; choose another mask_token")
