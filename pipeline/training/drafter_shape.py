"""The drafter the run builds: the user's DrafterShape (pipeline/config/train.py) resolved
against the target, where a shape setting left unset is the target's (DESIGN 2: a target's
reference drafter may differ from it, as Qwen3.6-27B's does), into the DrafterConfig the model is
built from and checked by."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.config import DrafterShape
from pipeline.drafter.config import DrafterConfig
from pipeline.errors import PipelineError
from pipeline.target_model import TargetFacts
from pipeline.training.mask_token import resolve_mask_token


def drafter_config(shape: DrafterShape, facts: TargetFacts, target_dir: Path, taps: list[int], *,
                   projected_rank: int | None = None) -> DrafterConfig:
    """The DrafterConfig of `shape` on this target and these taps; on a projected cache
    (`projected_rank` R: its basis's width), fc reads the R stored values a token, in the form
    `shape.projected_fc` names."""
    text = json.loads((target_dir / "config.json").read_text())
    text = text.get("text_config") or text
    heads = shape.num_attention_heads or facts.num_attention_heads
    mask_id, mask_text = resolve_mask_token(shape.mask_token, target_dir, facts)
    try:
        return DrafterConfig(
            hidden_size=facts.hidden_size, intermediate_size=shape.intermediate_size or int(text["intermediate_size"]),
            num_hidden_layers=shape.num_hidden_layers, num_attention_heads=heads,
            num_key_value_heads=shape.num_key_value_heads or (facts.num_key_value_heads if not shape.num_attention_heads else heads),
            head_dim=shape.head_dim or int(text.get("head_dim") or facts.hidden_size // facts.num_attention_heads),
            vocab_size=facts.vocab_size, target_layer_ids=list(taps), num_target_layers=facts.num_hidden_layers,
            mask_token_id=mask_id, mask_token=mask_text, block_size=shape.block_size,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=shape.rope_theta or float(text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta")
                                               or 10000.0),
            max_position_embeddings=shape.max_position_embeddings or int(text.get("max_position_embeddings", 32768)),
            layer_types=shape.layer_types, sliding_window=shape.sliding_window, draft_vocab_size=shape.draft_vocab,
            projected_rank=projected_rank,
            projected_energy=projected_rank is not None and shape.projected_fc == "energy")
    except ValueError as e:
        raise PipelineError(f"drafter config: {e}") from None
