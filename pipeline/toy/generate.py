"""Regenerate every assistant turn of a conversation set greedily with the target itself.

DESIGN 3.7: drafters learn the target's distribution, so the training responses come from the
target. Turn by turn: the target answers the first user message, its answer becomes the
history for the next user message, and so on.

Prompts are batched only with prompts of the same token length, so no padding enters the
forward pass and a batched answer equals the unbatched one.
"""

from __future__ import annotations

from collections import defaultdict

import torch


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int, batch_size: int = 64) -> list[str | None]:
    """Greedy answer text for each prompt (messages ending in a user turn); None if it never ended."""
    end_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    encoded = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in encoded]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_length[len(ids)].append(i)
    answers: list[str | None] = [None] * len(prompts)
    for length in sorted(by_length):
        members = by_length[length]
        for start in range(0, len(members), batch_size):
            chunk = members[start:start + batch_size]
            ids = torch.tensor([encoded[i] for i in chunk])
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                do_sample=False, eos_token_id=end_id, pad_token_id=tokenizer.pad_token_id,
            )
            for row, i in enumerate(chunk):
                new = out[row, length:].tolist()
                if end_id in new:
                    answers[i] = tokenizer.decode(new[:new.index(end_id)])
    return answers


def regenerate(model, tokenizer, conversations: list[list[dict]], *, max_new_tokens: int = 96) -> list[list[dict] | None]:
    """Replace every assistant turn with the target's greedy answer, in place order. A conversation
    whose answer never reached end-of-turn becomes None (dropped, never truncated)."""
    done: list[list[dict] | None] = [[] for _ in conversations]
    num_turns = max(sum(m["role"] == "assistant" for m in c) for c in conversations)
    for turn in range(num_turns):
        pending, prompts = [], []
        for i, conv in enumerate(conversations):
            if done[i] is None:
                continue
            cut = _index_of_assistant(conv, turn)
            if cut is None:
                continue
            prompts.append(done[i] + conv[len(done[i]):cut])
            pending.append(i)
        for i, prompt, answer in zip(pending, prompts, greedy_answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens)):
            done[i] = None if answer is None else prompt + [{"role": "assistant", "content": answer}]
    return done


def _index_of_assistant(conv: list[dict], turn: int) -> int | None:
    seen = 0
    for i, m in enumerate(conv):
        if m["role"] == "assistant":
            if seen == turn:
                return i
            seen += 1
    return None
