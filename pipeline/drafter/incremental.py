"""The drafter during decoding, with a KV cache of its context.

A drafting step sees the context (the target's tapped hidden states of every committed position)
and one block. Without a cache each step re-runs `fc`, `hidden_norm` and every layer's k/v
projections over the whole context: O(context) a step, O(n^2) a response. Here a position's
context features and each layer's rotated keys and values are computed once, when the position
is committed (`extend`), into buffers that grow by doubling; a step (`logits`) projects only the
block's B tokens. A full-attention layer still reads all cached keys (B queries x T keys, small);
a sliding-window layer reads only the window's.

A step runs the model's own layers (`DFlashDrafter.block_states`), handing them the cached keys
and values instead of the context features: the same computation per row as
`DFlashDrafter.forward` with the dense mask (eval's reference path). tests/drafter/test_incremental.py
checks the logits against that forward; tests/eval/test_eval.py the drafts, token for token.
"""

from __future__ import annotations

import torch

from pipeline.drafter.attention_rule import suffix_attention, window_start
from pipeline.drafter.model import DFlashDrafter, DraftAttention


class DraftContext:
    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.length = 0
        self._keys: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self._values: list[torch.Tensor | None] = [None] * len(drafter.layers)

    @torch.no_grad()
    def extend(self, hidden_TNH: torch.Tensor) -> None:
        """Commit the next positions' tapped hidden states [T, n, H]."""
        t = hidden_TNH.shape[0]
        if t == 0:
            return
        weight = self.drafter.fc.weight
        features = self.drafter.context_features(hidden_TNH[None].to(weight.device, weight.dtype))
        positions = torch.arange(self.length, self.length + t, device=features.device)[None]
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.key_value(features, positions)
            self._keys[i] = self._append(self._keys[i], k)
            self._values[i] = self._append(self._values[i], v)
        self.length += t

    def _append(self, buffer: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """Write `new` [1, kv, t, D] after the first `self.length` positions of `buffer`, growing it
        by doubling (a step appends in O(t), not O(context))."""
        end = self.length + new.shape[2]
        if buffer is None or buffer.shape[2] < end:
            grown = new.new_empty(*new.shape[:2], max(end, 2 * (0 if buffer is None else buffer.shape[2]), 64), new.shape[3])
            if buffer is not None:
                grown[:, :, :self.length] = buffer[:, :, :self.length]
            buffer = grown
        buffer[:, :, self.length:end] = new
        return buffer

    @torch.no_grad()
    def logits(self, anchor: int, anchor_pos: int) -> torch.Tensor:
        """Drafter logits [B-1, V] for the positions after `anchor`, which sits at `anchor_pos`
        (= the committed length: the context is every position before it)."""
        if anchor_pos != self.length:
            raise ValueError(f"the anchor at {anchor_pos} must follow the committed context of {self.length} positions")
        d = self.drafter
        c = d.config
        device = d.fc.weight.device
        ids = torch.full((1, c.block_size), c.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = anchor
        block_pos = torch.arange(anchor_pos, anchor_pos + c.block_size, device=device)[None]
        states = d.block_states(ids, block_pos, self._visible_keys_values, suffix_attention(block_pos), d.fc.weight.dtype)
        return d.target_logits(states)[0, 1:].float()

    def _visible_keys_values(self, attn: DraftAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached context keys and values [1, kv, t, D] that layer `attn.layer`'s block can
        see: all of them, or in a sliding layer those from its window's start on (the block
        follows the whole context)."""
        keys, values = self._keys[attn.layer], self._values[attn.layer]
        if keys is None:  # nothing committed yet
            keys = values = attn.k_proj.weight.new_empty(1, attn.c.num_key_value_heads, 0, attn.c.head_dim)
        low = window_start(self.length, attn.window)
        return keys[:, :, low:self.length], values[:, :, low:self.length]
