"""A random-weight target with a real tokenizer: the embedded target's layer layout at a real
vocabulary size, for tests and benchmarks of what the vocabulary and the tokenizer cost.

    python -m pipeline.toy.random_target --tokenizer DIR --template FILE.jinja --out DIR [--hidden 64]

The weights are random (seeded), so its predictions mean nothing; what is real is the tokenizer
(e.g. Qwen3.5/3.6's 248,077 ids), the chat template, the vocabulary size of the embedding and
lm_head (Qwen3.6-27B's 248,320 rows) and the architecture class. Nothing is downloaded: the
tokenizer and template are local files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pipeline.toy.model import tiny_config

QWEN3_6_VOCAB_SIZE = 248320   # Qwen3.6-27B's config.json: the embedding padded past the tokenizer's ids


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
    args = parser.parse_args()
    out = build_random_target(args.out, args.tokenizer, args.template, vocab_size=args.vocab_size,
                              hidden_size=args.hidden, seed=args.seed)
    print(json.dumps({"target": str(out), "vocab_size": args.vocab_size, "hidden_size": args.hidden}))


if __name__ == "__main__":
    main()
