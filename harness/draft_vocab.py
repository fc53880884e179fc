"""A trained drafter drafting from a draft vocabulary: the same weights, embedding and lm_head,
its head cut to the vocabulary's rows (pipeline/drafter/vocab.py). What the decoding tests and
benchmarks use to put a vocabulary in front of a drafter without training one for it."""

from __future__ import annotations

import dataclasses

from pipeline.drafter.model import DFlashDrafter
from pipeline.drafter.vocab import DraftVocab


def with_draft_vocab(model: DFlashDrafter, vocab: DraftVocab) -> DFlashDrafter:
    if model.draft_vocab is not None:
        raise ValueError("the drafter has a draft vocabulary already")
    config = dataclasses.replace(model.config, draft_vocab_size=vocab.size)
    out = DFlashDrafter(config, embed=model._frozen["embed"], lm_head=model._frozen["lm_head"], draft_vocab=vocab)
    out.load_state_dict(model.state_dict())
    return out.to(model.fc.weight.device).train(model.training)
