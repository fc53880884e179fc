"""A random-weight target with a real tokenizer: the embedded target's layer layout at a real
vocabulary size, for tests and benchmarks of what the vocabulary and the tokenizer cost.

    python -m pipeline.toy.random_target --tokenizer DIR --template FILE.jinja --out DIR [--hidden 64]
    python -m pipeline.toy.random_target --tokenizer DIR --template FILE.jinja --out DIR --flagship-layers 8

The weights are random (seeded), so its predictions mean nothing; what is real is the tokenizer
(e.g. Qwen3.5/3.6's 248,077 ids), the chat template, the vocabulary size of the embedding and
lm_head (Qwen3.6-27B's 248,320 rows) and the architecture class. Nothing is downloaded: the
tokenizer and template are local files. `--flagship-layers N` builds Qwen3.6-27B's own config
(every width as the checkpoint has it) cut to N layers: the flagship dress rehearsal's target
(benchmarks/flagship/rehearsal.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pipeline.toy.model import tiny_config

QWEN3_6_VOCAB_SIZE = 248320   # Qwen3.6-27B's config.json: the embedding padded past the tokenizer's ids


# Qwen3.6-27B's text model, field by field (`text_config` of its config.json; model_type
# qwen3_5, class Qwen3_5ForConditionalGeneration, whose text part AutoModelForCausalLM loads as
# Qwen3_5ForCausalLM). Public sources, cross-checked:
# - the model card of Qwen/Qwen3.6-27B on the Hugging Face Hub ("Model Overview"): hidden 5120,
#   token embedding 248,320 (padded), 64 layers laid out 16 x (3 x (Gated DeltaNet -> FFN) ->
#   1 x (Gated Attention -> FFN)); Gated DeltaNet 48 V heads and 16 QK heads of dim 128; gated
#   attention 24 Q and 4 KV heads of dim 256, rotary dimension 64; FFN intermediate 17,408; LM
#   output 248,320; native context 262,144; trained with multi-step prediction (MTP);
# - its config.json as quoted field by field in public write-ups (e.g. eadst.com/blog/325: layer_types
#   linear_attention x 3 + full_attention, max_position_embeddings 262144, rope_theta 10,000,000,
#   bf16, 15 safetensors files) and in public code that rebuilds the Qwen3.5/3.6-27B configuration
#   for transformers' Qwen3_5Config (attn_output_gate, full_attention_interval 4,
#   linear_conv_kernel_dim 4, mamba_ssm_dtype float32, partial_rotary_factor 0.25, rms_norm_eps
#   1e-6, mrope_section [11, 11, 10] interleaved, mtp_num_hidden_layers 1, untied embeddings,
#   eos 248044 in the text config);
# - THUDM/slime's scripts/models/qwen3.5-27B.sh (the same widths for Megatron: 24 heads, 4 query
#   groups, kv channels 256, ffn 17408, rotary percent 0.25, rotary base 1e7, untied, vocab 248320).
# presets/qwen3.6-27b.toml states the same target facts (tests/target_model/test_flagship_config.py).
QWEN3_6_27B_TEXT_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "bos_token_id": None,
    "eos_token_id": 248044,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 17408,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_5_text",
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 24,
    "num_hidden_layers": 64,
    "num_key_value_heads": 4,
    "pad_token_id": None,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                        "rope_theta": 10000000, "rope_type": "default"},
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 248320,
}


def flagship_layer_types(num_layers: int) -> list[str]:
    """Qwen3.6-27B's layout cut to `num_layers` (a multiple of 4): linear x3 then full, repeated."""
    if num_layers < 4 or num_layers % 4:
        raise ValueError(f"the flagship layout repeats every 4 layers; {num_layers} is not a multiple of 4")
    return ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (num_layers // 4)


def flagship_config(num_layers: int) -> dict:
    """Qwen3.6-27B's text config with only `num_hidden_layers` and `layer_types` changed."""
    return {**QWEN3_6_27B_TEXT_CONFIG, "num_hidden_layers": num_layers, "layer_types": flagship_layer_types(num_layers)}


def build_flagship_target(out: Path, tokenizer_dir: Path, template: Path, *, num_layers: int = 8, seed: int = 0,
                          weights: bool = True) -> Path:
    """A random-weight `Qwen3_5ForCausalLM` at Qwen3.6-27B's real widths and `num_layers` layers
    (bf16 weights, built in bf16 so the build never holds an fp32 copy), with the
    real tokenizer and chat template. `weights=False` writes config and tokenizer only (what
    `extract --dry-run` reads)."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = Path(template).read_text()
    fields = flagship_config(num_layers)
    if weights:
        config = Qwen3_5TextConfig(**{k: v for k, v in fields.items() if k != "torch_dtype"})
        previous = torch.get_default_dtype()
        torch.manual_seed(seed)
        # Built in bf16 (transformers' own initialisation, in place): 8 layers at 5120 are 11 GB,
        # an fp32 build would need twice that.
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = Qwen3_5ForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(tokenizer.chat_template)
    # The config as the checkpoint states it (save_pretrained writes transformers' own rendering).
    (out / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    return out


def build_random_target(out: Path, tokenizer_dir: Path, template: Path, *, vocab_size: int = QWEN3_6_VOCAB_SIZE,
                        hidden_size: int = 64, seed: int = 0) -> Path:
    """Write a `Qwen3_5ForCausalLM` directory (config, safetensors, tokenizer, chat template) to
    `out`; returns `out`. The layer layout is the embedded target's (8 layers, linear x3 then
    full, twice); the width is `hidden_size`."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = Path(template).read_text()
    if len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} ids, more than vocab_size {vocab_size}")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = tiny_config(vocab_size=vocab_size, eos_id=end, pad_id=pad)
    heads = max(1, hidden_size // 32)
    config.hidden_size, config.intermediate_size = hidden_size, hidden_size * 5 // 2
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = heads, 1, hidden_size // heads
    config.linear_key_head_dim = config.linear_value_head_dim = hidden_size // 4
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(tokenizer.chat_template)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer directory (tokenizer.json ...)")
    parser.add_argument("--template", type=Path, required=True, help="the chat template (.jinja)")
    parser.add_argument("--out", type=Path, required=True, help="where the target directory is written")
    parser.add_argument("--vocab-size", type=int, default=QWEN3_6_VOCAB_SIZE, help="embedding rows (default 248,320)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    parser.add_argument("--flagship-layers", type=int, default=None,
                        help="build Qwen3.6-27B's own config instead, cut to this many layers (a multiple of 4); "
                             "--hidden and --vocab-size are then the flagship's")
    parser.add_argument("--no-weights", action="store_true", help="with --flagship-layers: config and tokenizer only")
    args = parser.parse_args()
    if args.flagship_layers is not None:
        out = build_flagship_target(args.out, args.tokenizer, args.template, num_layers=args.flagship_layers,
                                    seed=args.seed, weights=not args.no_weights)
        print(json.dumps({"target": str(out), "num_hidden_layers": args.flagship_layers, "weights": not args.no_weights}))
        return
    out = build_random_target(args.out, args.tokenizer, args.template, vocab_size=args.vocab_size,
                              hidden_size=args.hidden, seed=args.seed)
    print(json.dumps({"target": str(out), "vocab_size": args.vocab_size, "hidden_size": args.hidden}))


if __name__ == "__main__":
    main()
