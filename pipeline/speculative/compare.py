"""Every decoding variant on the same prompts, for `pipeline eval`: plain greedy or plain sampling
(the reference and the speed baseline), block speculative decoding and DDTree at each node
budget, timed apart."""

from __future__ import annotations

import time

from pipeline.speculative.batched import decode_rows
from pipeline.speculative.decode import Decoded, block_decode, greedy, tree_decode
from pipeline.speculative.sampling import Sampling
from pipeline.target_model.live import LiveTarget


def decode_variants(live: LiveTarget, drafter, prompts: list[list[int]], *, max_new: int, eos: set[int],
                    tree_budgets: list[int], tree_top_k: int, tree_verify: str, batch_size: int = 1, progress=None,
                    sampling: Sampling | None = None
                    ) -> tuple[list[Decoded], list[Decoded], dict[int, list[Decoded]], dict[str, float]]:
    """(reference, block, {budget: tree} results per prompt, seconds per variant); the reference
    is plain greedy decoding, or plain sampling with `sampling` (prompt i's random numbers keyed
    by i, in every variant). With batch_size > 1 the speculative variants decode that many
    prompts together (one tree pass over their nodes). `progress(prompts, tokens=, note=)` after
    each batch of prompts. The reference's time is under "greedy" either way."""
    reference, blocks, trees = [], [], {b: [] for b in tree_budgets}
    seconds = {"greedy": 0.0, "block": 0.0, **{f"tree{b}": 0.0 for b in tree_budgets}}
    for first in range(0, len(prompts), batch_size):
        # Variants alternate per prompt (per batch of prompts), so machine drift hits them all alike.
        chunk = prompts[first:first + batch_size]
        row_ids = list(range(first, first + len(chunk)))
        t0 = time.perf_counter()
        reference += [greedy(live, ids, max_new=max_new, eos=eos, sampling=sampling, row=i) for i, ids in zip(row_ids, chunk)]
        seconds["greedy"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        if batch_size > 1:
            blocks += decode_rows(live, drafter, chunk, max_new=max_new, eos=eos, sampling=sampling, row_ids=row_ids)
        else:
            blocks.append(block_decode(live, drafter, chunk[0], max_new=max_new, eos=eos, sampling=sampling, row=first))
        seconds["block"] += time.perf_counter() - t0
        for b in tree_budgets:
            t0 = time.perf_counter()
            if batch_size > 1:
                trees[b] += decode_rows(live, drafter, chunk, max_new=max_new, eos=eos, budget=b, top_k=tree_top_k,
                                        sampling=sampling, row_ids=row_ids)
            else:
                trees[b].append(tree_decode(live, drafter, chunk[0], max_new=max_new, eos=eos, budget=b,
                                            top_k=tree_top_k, verify=tree_verify, sampling=sampling, row=first))
            seconds[f"tree{b}"] += time.perf_counter() - t0
        if progress:
            new_tokens = sum(len(r.tokens) for r in blocks[-len(chunk):])
            steps = [a + 1 for r in blocks for a in r.accepted]
            progress(len(chunk), tokens=new_tokens, note=f"block tau {sum(steps) / max(len(steps), 1):.2f}")
    return reference, blocks, trees, seconds
