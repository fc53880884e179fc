"""Loading the target: its tokenizer, the whole model (optionally tensor-parallel, by the plan
below), or only its frozen embedding and lm_head (what training needs). Nothing is downloaded; transformers and torch
are imported inside the functions (heavy: `pipeline --help` and fact reading stay fast)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.target_model.facts import TOKENIZER_FILES


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


def load_target(path: Path, *, dtype=None, **kwargs):
    """The target model from a local directory (float32 unless told), eval mode; nothing downloaded."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.target_model.internals import LOAD_WITHOUT_HUB_KERNELS

    _quiet_transformers()
    if not list(path.glob("*.safetensors")) + list(path.glob("*.bin")):
        raise PipelineError(f"{path}: no weight files (*.safetensors) in the target directory")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype or torch.float32,
                                                     **LOAD_WITHOUT_HUB_KERNELS, **kwargs)
    except OSError as e:
        raise PipelineError(f"{path}: cannot load the target ({str(e).splitlines()[0]})") from None
    return model.eval()


# Tensor-parallel loading, with transformers' DistributedConfig. transformers' default plan for
# qwen3_5 shards attention q/k/v column-wise by head, which fails when the KV heads do not divide
# by the TP size (Qwen3.6-27B: 4 KV heads, TP 8). Our plan keeps the default for the MLP and the
# Gated DeltaNet projections and replicates `self_attn` whenever the KV heads do not divide: the
# full-attention layers are a quarter of the stack, so the extra memory is small and the result is
# exact.
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def attention_plan(num_key_value_heads: int, tp: int) -> tuple[dict[str, str], str]:
    """(plan overrides, one-line description for the manifest)."""
    from pipeline.target_model.internals import replicated_style

    if num_key_value_heads % tp == 0:
        return {}, f"default (attention sharded by head: {num_key_value_heads} KV heads / tp {tp})"
    overrides = {f"model.layers.*.self_attn.{part}": replicated_style() for part in ATTENTION_PARTS}
    return overrides, f"self_attn replicated ({num_key_value_heads} KV heads do not divide by tp {tp})"


def tp_load_kwargs(layout, num_key_value_heads: int) -> tuple[dict, str]:
    """(from_pretrained's keyword arguments, the plan's description) for the tensor-parallel group
    of `layout` (pipeline.distributed.Layout)."""
    from pipeline.target_model.internals import distributed_config

    overrides, description = attention_plan(num_key_value_heads, layout.tp)
    config = distributed_config(layout.tp, layout.dp, overrides or "auto")
    return {"distributed_config": config}, description


def load_target_on_layout(target_dir: Path, dtype, device, layout, num_kv_heads: int):
    """(model, tensor-parallel plan description or None): whole on `device`, or split over the
    tensor-parallel group of `layout` (pipeline.distributed.Layout) when its tp > 1."""
    kwargs, plan = {}, None
    if layout.tp > 1:
        kwargs, plan = tp_load_kwargs(layout, num_kv_heads)
    model = load_target(target_dir, dtype=dtype, **kwargs)
    if layout.tp == 1:
        model = model.to(device)
    return model, plan


# Where the embedding lives: text-only checkpoints, and the multimodal layout's language model.
EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


def frozen_target_modules(target_dir: Path, dtype=None):
    """(embed_tokens, lm_head) of the target, read from its safetensors (nothing else is loaded),
    frozen, in `dtype` (float32 unless told) once: the compute dtype, since bf16 halves their 5 GB
    each at the flagship vocabulary and nothing casts them per step. Stored in that dtype, they
    stay mapped from the file as safetensors gives them (not copied): ranks of one node share one
    page-cache copy instead of each holding 5 GB of anonymous memory. A checkpoint without an
    lm_head weight has it tied to the embedding."""
    import torch

    from safetensors import SafetensorError, safe_open

    dtype = dtype or torch.float32
    index = target_dir / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    wanted = {"embed": EMBED_NAMES, "lm_head": ("lm_head.weight",)}
    found = {}
    for role, names in wanted.items():
        for name in names:
            path = target_dir / (files.get(name, "") if files else "model.safetensors")
            if not path.is_file():
                continue
            try:
                with safe_open(str(path), "pt") as f:
                    if name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                        found[role] = f.get_tensor(name).to(dtype)
                        break
            except (SafetensorError, OSError) as e:  # a damaged file, not a failure of the cast after it
                raise PipelineError(f"{path}: not a readable safetensors file ({e})") from None
    if "embed" not in found:
        raise PipelineError(f"{target_dir}: no embed_tokens weight in the target's safetensors")
    weight = found["embed"]
    embed = torch.nn.Embedding.from_pretrained(weight, freeze=True)
    # Built on the meta device: a real one would first fill a random weight as large as the
    # embedding (5 GB in fp32 at the flagship vocabulary) only to drop it on the next line.
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = torch.nn.Parameter(found.get("lm_head", weight), requires_grad=False)
    return embed, head
