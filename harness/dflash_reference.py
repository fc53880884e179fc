"""z-lab's reference implementation (`dflash`, installed from PyPI with --no-deps; never copied into
the repository) as tests/drafter reach it: the module, pinned to the release whose attention rule
and cache calls those tests were written against, and its `spec_generate` run on a CPU with the
two adaptations that needs, each outside its algorithm (`observed_spec_generate`)."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import time
from types import SimpleNamespace

import pytest
import torch

from harness.prerequisites import importable, needs

VERSION = "0.1.0"
INSTALL = f"z-lab's reference package dflash (pip install --no-deps dflash=={VERSION})"

# A mark for tests that need the package: read before their fixtures are built (a decoding test's
# trained drafter takes minutes), a skip where it is missing, a failure under CI=true, which installs it.
needs_reference = needs(importlib.util.find_spec("dflash") is not None, INSTALL)


def reference_module():
    """`dflash.model`: `missing` where it does not import, a failure where another release is
    installed: its attention rule and its cache calls were read in this one, and a new release is
    a change to read, then to pin here."""
    from importlib.metadata import version

    module = importable("dflash.model", INSTALL)
    if version("dflash") != VERSION:
        pytest.fail(f"dflash {version('dflash')} is installed; tests/drafter describe dflash=={VERSION}", pytrace=False)
    return module


def observed_spec_generate(dflash, monkeypatch, drafter, target, prompt: list[int], *, max_new: int,
                           eos: set[int]) -> SimpleNamespace:
    """The reference drafter's own `spec_generate` (greedy) on `target`: (tokens after the prompt,
    the acceptance length of each step as it records them, each step's draft tokens).

    Two things around its algorithm are adapted, for the duration of the test (`monkeypatch`):
    - The cache's rollback. `dflash_generate` makes each cache with `activate_past_recording()`,
      no argument, and later crops the target's cache back to the accepted tokens. Transformers
      5.25's linear-attention cache layers (the embedded target's Gated DeltaNet layers) then
      keep `recurrent_states_to_keep=None`, and the next forward fails (`min(None, seq_len)` in
      the Qwen3.5 modeling); what their `crop` restores a recurrent state from is the states of
      the last N tokens of a pass, N being that argument. A verify pass is the block (B tokens)
      and a crop removes up to B - 1 of them, so the cache is asked for N = B, the number of
      states its rollback reads, where the layer takes the argument (5.25; an older release's
      cache is left as the reference makes it). Nothing else of the cache changes.
      tests/drafter/test_reference_decoding.py checks that the argument is still needed.
    - Its per-step statistics. `spec_generate` does not ask `dflash_generate` for them
      (`return_stats`), and with them `dflash_generate` times itself by `torch.cuda.synchronize`,
      which a CPU-only torch refuses: it is called with `return_stats=True` and a host clock.
    The draft tokens are read, not changed, from the logits its `compute_logits` returns."""
    from transformers import DynamicCache

    keep = int(drafter.block_size)

    class RollbackCache(DynamicCache):
        def activate_past_recording(self, **kwargs):
            linear = [layer for layer in self.layers if hasattr(layer, "recurrent_states")]
            if linear and "recurrent_states_to_keep" in inspect.signature(linear[0].activate_past_recording).parameters:
                kwargs.setdefault("recurrent_states_to_keep", keep)
            super().activate_past_recording(**kwargs)

    monkeypatch.setattr(dflash, "DynamicCache", RollbackCache)
    monkeypatch.setattr(dflash, "_cuda_time", time.perf_counter)
    monkeypatch.setattr(dflash, "dflash_generate", functools.partial(dflash.dflash_generate, return_stats=True))
    drafts: list[list[int]] = []
    compute_logits = drafter.compute_logits

    def observed(hidden, head):
        logits = compute_logits(hidden, head)
        drafts.append(logits.argmax(-1)[0].tolist())
        return logits

    monkeypatch.setattr(drafter, "compute_logits", observed)
    stats = drafter.spec_generate(target, torch.tensor([prompt]), max_new_tokens=max_new, stop_token_ids=sorted(eos))
    return SimpleNamespace(tokens=stats.output_ids[0, len(prompt):].tolist(), acceptance=list(stats.acceptance_lengths),
                           drafts=drafts)
