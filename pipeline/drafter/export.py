"""Drafter export in the format the DFlash reference and its serving integrations load (DESIGN 8).

config.json: a Qwen3 decoder config plus `block_size`, `num_target_layers`,
`dflash_config: {target_layer_ids, mask_token_id, block_size, mask_token}` and
`architectures: ["DFlashDraftModel"]` (SGLang reads the block size and the mask token's text from
`dflash_config`, and checks the text against the id in the target's tokenizer; a mask row past the
tokenizer's vocabulary has no text and is written without one);
the layer kinds as transformers' Qwen3Config reads them (`layer_types`, `sliding_window`, and
`use_sliding_window`, without which Qwen3Config drops the window), the rope settings in both
spellings (`rope_theta`, `rope_parameters`), and the weights' dtype (`torch_dtype`, `dtype`).
model.safetensors: layers.{i}.self_attn.{q,k,v,o}_proj, layers.{i}.self_attn.{q,k}_norm,
layers.{i}.mlp.{gate,up,down}_proj, layers.{i}.{input,post_attention}_layernorm, norm, fc,
hidden_norm. No embedding and no lm_head: those are the target's. With a draft vocabulary (DESIGN
3.4, 8) the head is the drafter's own: config.json adds `draft_vocab_size` K, model.safetensors
`lm_head.weight` (the K rows of the target's lm_head), `d2t` [K] int64 offsets (target id = draft
id + d2t) and `t2d` [V] bool, the names and formats speculators writes and vLLM's DFlash model
reads (it maps `d2t` to `draft_id_to_target_id` and skips `t2d`). Loading reads safetensors and
JSON only (nothing is unpickled) and checks every name and shape before use.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.drafter.config import SLIDING, DrafterConfig
from pipeline.drafter.model import DFlashDrafter
from pipeline.drafter.vocab import DraftVocab
from pipeline.errors import PipelineError
from pipeline.files import fsync_dir, fsync_tree


@dataclasses.dataclass(frozen=True)
class ExportDir:
    """An export's files, named here once: the names the reference and the serving engines load
    (DESIGN 8), which checkpoints (each holds an export of its drafter) and eval read through this."""
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @property
    def config(self) -> Path:
        return self.path / "config.json"

    @property
    def weights(self) -> Path:
        return self.path / "model.safetensors"


# The tensors a draft vocabulary adds to model.safetensors (outside the module's state_dict).
HEAD_TENSORS = ("lm_head.weight", "d2t", "t2d")

CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "rms_norm_eps", "vocab_size")


def export_drafter(drafter: DFlashDrafter, out: Path, dtype: torch.dtype | None = None, *, basis=None) -> None:
    """Write config.json and model.safetensors into `out` (atomically, via a temporary folder),
    the weights in `dtype` (default: as they are; the final export of a bf16 run passes bf16,
    DESIGN 8; checkpoints keep the fp32 master weights for an exact resume). A drafter trained on
    projected taps (`config.projected_rank`) needs its cache's `basis` (pipeline/projection/
    basis.py): its fc is folded into an fc on the full taps, and the export is an ordinary
    drafter that computes from them what was trained on the projection. Without the basis it is
    written as trained, `projected_rank` in config.json: a checkpoint's form, which no engine
    serves."""
    c = drafter.config
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in drafter.state_dict().items()}
    if c.projected_rank is not None and basis is not None:
        state["fc.weight"] = _folded_fc(drafter, basis).to(dtype or drafter.fc.weight.dtype).contiguous()
        c = dataclasses.replace(c, projected_rank=None, projected_energy=False)
    dtype_name = str(next(iter(state.values())).dtype).removeprefix("torch.")
    vocab = drafter.draft_vocab
    if vocab is not None:
        head = drafter.lm_head_weight.detach()
        state.update({"lm_head.weight": head.to("cpu", dtype or head.dtype).contiguous(),
                      "d2t": vocab.d2t().contiguous(), "t2d": vocab.t2d().contiguous()})
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
        "dflash_config": _dflash_config(c),
    }
    if c.draft_vocab_size is not None:
        config["draft_vocab_size"] = c.draft_vocab_size
    if c.projected_rank is not None:
        config["projected_rank"] = c.projected_rank
        config["projected_energy"] = c.projected_energy
    # The two files are written into a temporary folder renamed into place, not each replaced on
    # its own: a crash between the two would pair a new config with old weights.
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    written = ExportDir(tmp)
    save_file(state, str(written.weights), metadata={"format": "pt"})
    written.config.write_text(json.dumps(config, indent=2) + "\n")
    fsync_tree(tmp)
    if out.exists():
        for p in out.iterdir():
            p.unlink()
        out.rmdir()
    os.replace(tmp, out)
    fsync_dir(out.parent)


def _folded_fc(drafter: DFlashDrafter, basis) -> torch.Tensor:
    c = drafter.config
    width = len(c.target_layer_ids) * c.hidden_size
    if (basis.projected_rank, basis.width) != (c.projected_rank, width):
        raise PipelineError(f"the basis projects {basis.width} values to {basis.projected_rank}, the drafter's fc reads "
                            f"{c.projected_rank} projected from {width}")
    weight = drafter.fc.weight.detach().to("cpu", torch.float32)
    if c.projected_energy:  # fc' computed W' (s * z): the same map as W' diag(s) on the stored z
        if drafter.tap_scales is not None and not torch.equal(drafter.tap_scales.cpu(), basis.scales.to(torch.float32)):
            raise PipelineError("the basis given to the export is not the one the drafter was trained with")
        weight = weight * basis.scales.to(torch.float32)
    return basis.fold(weight)


def _dflash_config(c: DrafterConfig) -> dict:
    """The `dflash_config` table: the taps and the mask as the reference reads them, with the block
    size repeated and the mask token's text where SGLang looks for them."""
    table = {"target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id, "block_size": c.block_size}
    if c.mask_token is not None:
        table["mask_token"] = c.mask_token
    return table


def read_config(path: Path) -> DrafterConfig:
    """The drafter config of an export, read as transformers' Qwen3Config reads it: the window
    counts only with `use_sliding_window`, and without `layer_types` every layer is full."""
    config_file = ExportDir(path).config
    try:
        raw = json.loads(config_file.read_text())
        dflash = raw["dflash_config"]
        theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return DrafterConfig(**{k: raw[k] for k in CONFIG_KEYS}, rope_theta=float(theta),
                             block_size=int(raw["block_size"]), num_target_layers=int(raw["num_target_layers"]),
                             target_layer_ids=list(dflash["target_layer_ids"]), mask_token_id=int(dflash["mask_token_id"]),
                             mask_token=dflash.get("mask_token"),
                             max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                             layer_types=raw.get("layer_types"),
                             sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window") else None,
                             draft_vocab_size=_draft_vocab_size(raw), **_projection(raw))
    except FileNotFoundError:
        raise PipelineError(f"{path}: no {config_file.name}") from None
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        raise PipelineError(f"{config_file}: not a DFlash drafter config ({type(e).__name__}: {e})") from None


# config.json's keys for R and its energy flag in a checkpoint written before R had one name: such
# a checkpoint still resumes, and still exports, under the keys of today.
_PROJECTION_KEYS_BEFORE = {"projected_rank": "tap_projection", "projected_energy": "tap_projection_energy"}


def _projection(raw: dict) -> dict:
    """projected_rank (R) and projected_energy of a checkpoint's config.json, under today's keys
    or the older ones (an export on the full taps has neither: None, False)."""
    def stored(key: str):
        return raw[key] if key in raw else raw.get(_PROJECTION_KEYS_BEFORE[key])
    return {"projected_rank": stored("projected_rank"), "projected_energy": bool(stored("projected_energy") or False)}


def _draft_vocab_size(raw: dict) -> int | None:
    """K of an export's draft vocabulary; None when it has none (vLLM reads a missing one as the
    whole vocabulary)."""
    k = raw.get("draft_vocab_size")
    return None if k is None else int(k)


def split_head(state: dict, path: Path, vocab_size: int) -> tuple[dict, DraftVocab | None, torch.Tensor | None]:
    """(the module's state, the draft vocabulary, the head's rows) of an export's tensors."""
    weights = ExportDir(path).weights
    head = {k: state.pop(k) for k in HEAD_TENSORS if k in state}
    if not head:
        return state, None, None
    if "d2t" not in head or "lm_head.weight" not in head:
        raise PipelineError(f"{weights}: a draft vocabulary needs both d2t and lm_head.weight")
    try:
        vocab = DraftVocab.from_d2t(head["d2t"], vocab_size)
    except PipelineError as e:
        raise PipelineError(f"{weights}: d2t: {e}") from None
    if "t2d" in head and not torch.equal(head["t2d"].bool(), vocab.t2d()):
        raise PipelineError(f"{weights}: t2d does not mark the ids d2t maps to")
    return state, vocab, head["lm_head.weight"]


def load_drafter(path: Path, *, embed: torch.nn.Embedding, lm_head: torch.nn.Linear) -> DFlashDrafter:
    """The export at `path` with the target's frozen `embed` and `lm_head`. A draft vocabulary's
    head is built from `lm_head`'s rows, as in training; the export's copy of them (what a serving
    engine loads) must be those rows at the coarser of the two precisions, or the target is another
    one."""
    files = ExportDir(path)
    config = read_config(path)
    state, vocab, rows = split_head(load_file(str(files.weights)), path, config.vocab_size)
    if vocab is None and config.draft_vocab_size == config.vocab_size:  # another writer's "whole vocabulary"
        config.draft_vocab_size = None
    if (vocab is None) != (config.draft_vocab_size is None) or (vocab and vocab.size != config.draft_vocab_size):
        raise PipelineError(f"{path}: {files.config.name} draft_vocab_size {config.draft_vocab_size} does not match "
                            f"{files.weights.name} ({'no d2t' if vocab is None else f'{vocab.size} draft ids'})")
    drafter = DFlashDrafter(config, embed=embed, lm_head=lm_head, draft_vocab=vocab)
    if rows is not None:
        if tuple(rows.shape) != tuple(drafter.lm_head_weight.shape):
            raise PipelineError(f"{files.weights}: lm_head.weight has shape {tuple(rows.shape)}, "
                                f"expected {tuple(drafter.lm_head_weight.shape)}")
        # At the coarser of the two precisions: an fp32 run's export is evaluated in bf16, say.
        coarse = max(rows.dtype, drafter.lm_head_weight.dtype, key=lambda d: torch.finfo(d).eps)
        if not torch.equal(rows.to(coarse), drafter.lm_head_weight.detach().to("cpu", coarse)):
            raise PipelineError(f"{files.weights}: lm_head.weight is not the target's lm_head rows the "
                                "d2t names: this drafter was trained against another target")
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != expected:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise PipelineError(f"{files.weights}: does not match its config "
                            f"(missing {missing[:3]}, unexpected {extra[:3]}, wrong shape {wrong[:3]})")
    drafter.load_state_dict(state)
    return drafter
