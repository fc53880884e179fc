"""The tiny target's architecture: a real transformers `Qwen3_5ForCausalLM`, scaled down.

Shape choices mirror Qwen3.6-27B where it matters to the pipeline and to serving engines:
- both layer kinds, every 4th layer full attention (8 layers: linear x3, full, linear x3, full);
- 8 layers, so the default tap formula gives distinct taps ([1, 3, 5] for 3 taps);
- Qwen3.6-27B's 24:4 query:KV head ratio scaled to 6:1, so tensor-parallel tests meet the same
  "fewer KV heads than ranks" problem the real model meets at TP 8;
- Gated DeltaNet heads of dim 64 (the family's are 128), more value heads than key heads as in
  the family (4:2 here, both divisible by tensor-parallel 2): engines' kernels take head dims 64
  and 128 only (vLLM's CPU prefill), so vLLM serves this target unmodified;
- a vocabulary padded past the tokenizer, like Qwen's (unused rows are never produced).
"""

from __future__ import annotations

from transformers import Qwen3_5TextConfig

VOCAB_SIZE = 512


def tiny_config(*, vocab_size: int = VOCAB_SIZE, bos_id: int | None = None, eos_id: int, pad_id: int) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
