"""One forward of the target over a batch, capturing what the cache stores (DESIGN 3.1, 3.2).

Taps come from forward hooks on the tapped decoder layers (the output of layer i, which is what
`hidden_states[i + 1]` would be), so the model is not asked to materialise every layer's
states. The target's own prediction comes from its real output logits (final norm + lm_head),
computed in token chunks (`LogitChunks`) so a 248k vocabulary never needs a [batch, seq, vocab] tensor.

Batches are right-padded: the target is causal in every layer (attention, Gated DeltaNet,
its short convolution), so real positions never see the padding; padding is dropped before
anything is returned.
"""

from __future__ import annotations

import contextlib

import torch


class Taps:
    """The tapped decoder layers' outputs of one forward, by layer index."""

    def __init__(self, taps: list[int]):
        self.taps, self.outputs = list(taps), {}

    def hook(self, index: int):
        def keep(module, args, output):
            self.outputs[index] = output[0] if isinstance(output, tuple) else output
        return keep

    def stacked(self) -> torch.Tensor:
        """[batch, tokens, n_taps, H]."""
        return torch.stack([self.outputs[t] for t in self.taps], dim=2)


def right_padded(batch: list[list[int]], pad_id: int) -> torch.Tensor:
    """Token ids [len(batch), longest], each sample right-padded with `pad_id` (the target is causal,
    so real positions never see the padding)."""
    ids = torch.full((len(batch), max(len(sample) for sample in batch)), pad_id, dtype=torch.long)
    for row, sample in enumerate(batch):
        ids[row, :len(sample)] = torch.tensor(sample)
    return ids


@contextlib.contextmanager
def tapped_layers(model, taps: list[int], enabled: bool = True):
    """Keep the outputs of the tapped decoder layers during a forward, and nothing else (forward
    hooks: the output of layer i is `hidden_states[i + 1]`, DESIGN 3.1; `output_hidden_states`
    would hold every layer's states). Used by extraction and by the live target in eval."""
    captured = Taps(taps)
    layers = model.model.layers
    hooks = [layers[t].register_forward_hook(captured.hook(t)) for t in captured.taps] if enabled else []
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


class Capture:
    def __init__(self, model, target_layer_ids: list[int], *, top_k: int, logits_chunk: int = 256, pad_id: int = 0,
                 project=None):
        """`project`: what a sample's taps [T, n_taps, H] become on the device before they are
        copied to the host (a projected cache's basis: pipeline/projection), or None."""
        self.model = model
        self.project = project
        self.taps = list(target_layer_ids)
        self.top_k = top_k
        self.logits_chunk = logits_chunk
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self.logit_chunks = LogitChunks(model.lm_head, logits_chunk)

    @torch.no_grad()
    def __call__(self, batch: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        """Per sample: "hidden" [tokens, taps, H] (the tapped outputs, in the compute dtype, before
        encoding) and the target's predictions under their cache array names (the schema's
        hard- and soft-label arrays); pipeline.cache.encoding.encode_rows casts them to the stored
        dtypes and refuses a sample that lacks an array the schema declares."""
        ids = right_padded(batch, self.pad_id).to(self.device)

        with tapped_layers(self.model, self.taps) as taps:
            last = self.model.model(input_ids=ids, use_cache=False).last_hidden_state
        hidden_BTNH = taps.stacked()

        out = []
        for row, sample in enumerate(batch):
            n = len(sample)
            stats = self._prediction_stats(last[row, :n])
            hidden = hidden_BTNH[row, :n] if self.project is None else self.project(hidden_BTNH[row, :n])
            out.append({"hidden": hidden.cpu(), **{k: v.cpu() for k, v in stats.items()}})
        return out

    def _prediction_stats(self, last_TH: torch.Tensor) -> dict[str, torch.Tensor]:
        ids, logits, lse = [], [], []
        for _, chunk in self.logit_chunks(last_TH):
            top = torch.topk(chunk, self.top_k, dim=-1, sorted=True)
            lse.append(logsumexp_(chunk, top.values[:, 0]))
            ids.append(top.indices)
            logits.append(top.values)
        topk_ids = torch.cat(ids)
        return {
            "target_argmax": topk_ids[:, 0],
            "target_topk_ids": topk_ids,
            "target_topk_logits": torch.cat(logits),
            "target_logsumexp": torch.cat(lse),
        }


ROW_MULTIPLE = 16   # LogitChunks' matmuls take row counts of this multiple (see there why)


class LogitChunks:
    """The lm_head's float32 logits over hidden states [T, H], `rows` tokens at a time, so a 248k
    vocabulary never needs a [T, vocab] tensor. On the CPU in float32 each chunk is written into one
    reused buffer: a fresh tensor per chunk costs a page fault per 4 KiB (measured: the top-k and
    logsumexp of a 248k vocabulary took twice as long). A chunk is overwritten by the next one, so
    the caller may spend it in place (`logsumexp_`)."""

    def __init__(self, lm_head, rows: int = 256):
        if rows % ROW_MULTIPLE:
            raise ValueError(f"rows must be a multiple of {ROW_MULTIPLE}, got {rows}")
        self.lm_head, self.rows = lm_head, rows
        self._buffer: torch.Tensor | None = None
        self._rows_in: torch.Tensor | None = None

    def __call__(self, last_TH: torch.Tensor):
        weight = self.lm_head.weight
        # A plain CPU float32 matmul only: a tensor-parallel lm_head holds a DTensor and runs its own op.
        reuse = (last_TH.device.type == "cpu" and weight.dtype == torch.float32 and self.lm_head.bias is None
                 and type(weight.data) is torch.Tensor and type(last_TH) is torch.Tensor)
        if reuse and self._buffer is None:
            self._buffer = torch.empty(self.rows, weight.shape[0])
            self._rows_in = torch.empty(self.rows, weight.shape[1])
        for a in range(0, last_TH.shape[0], self.rows):
            hidden = last_TH[a:a + self.rows]
            if reuse:
                # The CPU BLAS sums some row counts (5-7 and 9-11 of them, measured) in an order that
                # depends on torch's thread count: a sample whose last chunk has such a count would
                # store other logits in a process with one thread (data-parallel ranks) than in one
                # with two. Rows padded with zeros to a multiple of ROW_MULTIPLE take the same path
                # at any thread count; the padding rows are computed and dropped.
                n = hidden.shape[0]
                if n % ROW_MULTIPLE == 0:   # every chunk but a sample's last: no copy needed
                    yield a, torch.matmul(hidden.float(), weight.T, out=self._buffer[:n])
                    continue
                m = -(-n // ROW_MULTIPLE) * ROW_MULTIPLE
                rows_in = self._rows_in[:m]
                rows_in[:n] = hidden
                rows_in[n:] = 0
                yield a, torch.matmul(rows_in, weight.T, out=self._buffer[:m])[:n]
            else:
                yield a, self.lm_head(hidden).float()


def logsumexp_(logits: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim, given each row's max, computed in place (`logits` is spent):
    no second vocabulary-sized tensor."""
    return logits.sub_(row_max[:, None]).exp_().sum(-1).log_().add_(row_max)


class _PassThrough(torch.nn.Module):
    """Stands in for a decoder layer whose output is already known (the stored tap)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


@torch.no_grad()
def tail_forward(model, deepest_tap: int, batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """The target's final hidden states (after the final norm) from a stored tap (DESIGN 10).

    The tap of layer i is `hidden_states[i + 1]`, exactly the input of layer i + 1, so layers
    0..i are replaced by pass-throughs for this call and the tap is fed as `inputs_embeds`:
    the model's own forward then runs layers i+1..L-1 with their real masks and rotary
    embeddings (layer indices unchanged). Costs (L-1-i)/L of a forward, plus the lm_head the
    caller applies. Batches are right-padded; every layer is causal, so padding is never seen."""
    width = max(len(t) for t in batch)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    x = torch.zeros(len(batch), width, batch[0].shape[-1], dtype=dtype, device=device)
    for row, tap in enumerate(batch):
        x[row, :len(tap)] = tap.to(device=device, dtype=dtype)
    layers = model.model.layers
    skipped = [layers[i] for i in range(deepest_tap + 1)]
    try:
        for i in range(deepest_tap + 1):
            layers[i] = _PassThrough()
        last = model.model(inputs_embeds=x, use_cache=False).last_hidden_state
    finally:
        for i, layer in enumerate(skipped):
            layers[i] = layer
    return [last[row, :len(tap)] for row, tap in enumerate(batch)]
