"""One real check that a target is the model the data came from: teacher-forced on conversations it
wrote, it predicts its own assistant tokens (agreement near 1.0)."""

from __future__ import annotations

import time

import torch

from pipeline.data.loss_mask import ConversationMasker


@torch.no_grad()
def self_agreement(model, tokenizer, rows: list, end_of_turn: str) -> dict:
    """Share of supervised tokens the target predicts itself (teacher-forced top-1). `rows`: parsed
    rows (pipeline/data/conversations.py), rendered with their own tools and template kwargs."""
    same = total = 0
    start = time.perf_counter()
    num_tokens = 0
    masker = ConversationMasker(tokenizer, end_of_turn)
    for row in rows:
        sample = masker(row.messages, tools=row.tools, row_kwargs=row.template_kwargs, where=row.where)
        ids = torch.tensor([sample.input_ids])
        predicted = model(input_ids=ids).logits[0, :-1].argmax(-1)
        mask = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
        same += (predicted == ids[0, 1:])[mask].sum().item()
        total += int(mask.sum())
        num_tokens += ids.shape[1]
    seconds = time.perf_counter() - start
    return {"agreement": same / max(total, 1), "supervised_tokens": total, "conversations": len(rows),
            "forward_tokens_per_s": num_tokens / seconds}
