"""Drafter export in the format the DFlash reference and its serving integrations load (DESIGN 8).

config.json: a Qwen3 decoder config plus `block_size`, `num_target_layers`,
`dflash_config: {target_layer_ids, mask_token_id}` and `architectures: ["DFlashDraftModel"]`;
the layer kinds as transformers' Qwen3Config reads them (`layer_types`, `sliding_window`, and
`use_sliding_window`, without which Qwen3Config drops the window), the rope settings in both
spellings (`rope_theta`, `rope_parameters`), and the weights' dtype (`torch_dtype`, `dtype`).
model.safetensors: layers.{i}.self_attn.{q,k,v,o}_proj, layers.{i}.self_attn.{q,k}_norm,
layers.{i}.mlp.{gate,up,down}_proj, layers.{i}.{input,post_attention}_layernorm, norm, fc,
hidden_norm. No embedding and no lm_head: those are the target's. Loading reads safetensors and
JSON only (nothing is unpickled) and checks every name and shape before use.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.drafter.config import SLIDING, DrafterConfig
from pipeline.drafter.model import DFlashDrafter
from pipeline.errors import PipelineError

CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "rms_norm_eps", "vocab_size")


def export_drafter(drafter: DFlashDrafter, out: Path, dtype: torch.dtype | None = None) -> None:
    """Write config.json and model.safetensors into `out` (atomically, via a temporary folder),
    the weights in `dtype` (default: as they are; the final export of a bf16 run passes bf16,
    DESIGN 8; checkpoints keep the fp32 master weights for an exact resume)."""
    c = drafter.config
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in drafter.state_dict().items()}
    dtype_name = str(next(iter(state.values())).dtype).removeprefix("torch.")
    sliding = any(kind == SLIDING for kind in c.layer_types)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **{k: getattr(c, k) for k in CONFIG_KEYS},
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings,
        "layer_types": list(c.layer_types),
        "use_sliding_window": sliding,
        "sliding_window": c.sliding_window if sliding else None,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {"target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id},
    }
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if out.exists():
        for p in out.iterdir():
            p.unlink()
        out.rmdir()
    os.replace(tmp, out)


def read_config(path: Path) -> DrafterConfig:
    """The drafter config of an export, read as transformers' Qwen3Config reads it: the window
    counts only with `use_sliding_window`, and without `layer_types` every layer is full."""
    try:
        raw = json.loads((path / "config.json").read_text())
        dflash = raw["dflash_config"]
        theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return DrafterConfig(**{k: raw[k] for k in CONFIG_KEYS}, rope_theta=float(theta),
                             block_size=int(raw["block_size"]), num_target_layers=int(raw["num_target_layers"]),
                             target_layer_ids=list(dflash["target_layer_ids"]), mask_token_id=int(dflash["mask_token_id"]),
                             max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                             layer_types=raw.get("layer_types"),
                             sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window") else None)
    except FileNotFoundError:
        raise PipelineError(f"{path}: no config.json") from None
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        raise PipelineError(f"{path}/config.json: not a DFlash drafter config ({type(e).__name__}: {e})") from None


def load_drafter(path: Path, *, embed: torch.nn.Embedding, lm_head: torch.nn.Linear) -> DFlashDrafter:
    config = read_config(path)
    drafter = DFlashDrafter(config, embed=embed, lm_head=lm_head)
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    state = load_file(str(path / "model.safetensors"))
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != expected:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise PipelineError(f"{path}/model.safetensors: does not match its config "
                            f"(missing {missing[:3]}, unexpected {extra[:3]}, wrong shape {wrong[:3]})")
    drafter.load_state_dict(state)
    return drafter
