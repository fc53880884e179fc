"""The draft vocabulary of one training run (`pipeline train --draft-vocab K`): counted once, on
rank 0, and never again on resume.

Choosing it reads the stored argmax and loss mask of the whole cache (pipeline/training/
draft_vocab.py): at 1e9 tokens about 5 GB, which every rank of every launch used to read. Now
rank 0 alone counts and chooses, and the other ranks receive the ids and run.json's record by a
broadcast; a refusal on rank 0 (K too small for the reserved tokens, a cache without labels)
stops every rank with its line.

A resume takes the vocabulary from the checkpoint it resumes from (its drafter's d2t) and the
record from run.json, which the launch that started the run wrote: the record stays as it was
and the cache is not read. A recount could only give the same ids, since a resume already
requires the same cache, K and max_length (checkpoint.check_resumable, which runs here first, so
a changed K is refused before anything is counted). Where run.json's record is missing or is not
the checkpoint's vocabulary (another sha256), rank 0 says so and counts again, and loading the
checkpoint then compares the two vocabularies, as it always has.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.distributed import decided_on_rank0
from pipeline.drafter.vocab import DraftVocab
from pipeline.errors import PipelineError
from pipeline.records.run import read_run_record
from pipeline.training.checkpoint import cache_identity, resumable_checkpoint, saved_draft_vocab
from pipeline.training.draft_vocab import choose_draft_vocab


def run_draft_vocab(size: int | None, reader, target_dir: Path, *, max_length: int, out: Path, run_config: dict,
                    vocab_size: int, mask_id: int, resume: bool, rank: int, world: int, warn
                    ) -> tuple[DraftVocab | None, dict | None]:
    """(the run's draft vocabulary of `size` tokens, run.json's record of it), the same on every
    rank; (None, None) without --draft-vocab. The labels are counted within `max_length`; `out`
    and `run_config` (the run's config) find the checkpoint a resume takes it from."""
    if size is None:
        return None, None

    def decide() -> tuple[np.ndarray, dict]:
        return (resumed_vocab(Path(out), run_config, reader, vocab_size, resume=resume, warn=warn)
                or counted_vocab(size, max_length, reader, target_dir, vocab_size=vocab_size, mask_id=mask_id))

    ids, record = decided_on_rank0(decide, rank=rank, world=world, what="choosing the draft vocabulary")
    return DraftVocab(ids, vocab_size), record


def counted_vocab(size: int, max_length: int, reader, target_dir: Path, *, vocab_size: int, mask_id: int
                  ) -> tuple[np.ndarray, dict]:
    """(ids, record) chosen by counting the cache's labels: one pass over its label arrays."""
    from pipeline.target_model import load_tokenizer

    vocab, record = choose_draft_vocab(reader, load_tokenizer(target_dir), size=size, vocab_size=vocab_size,
                                       mask_id=mask_id, max_length=max_length)
    return vocab.ids.numpy(), record


def resumed_vocab(out: Path, run_config: dict, reader, vocab_size: int, *, resume: bool, warn
                  ) -> tuple[np.ndarray, dict] | None:
    """(ids, record) of the checkpoint this run resumes from, None when it starts afresh or the
    record cannot be trusted to be that vocabulary's (then the caller counts)."""
    found = resumable_checkpoint(out, resume=resume, record=run_config, identity=cache_identity(reader.manifest))
    if found is None:
        return None
    vocab = saved_draft_vocab(found[0], vocab_size)
    record = recorded_vocab(out)
    if vocab is None or record is None or record.get("sha256") != vocab.digest():
        warn(f"{found[0]}: run.json records no draft vocabulary with this checkpoint's sha256; counting the cache's "
             "labels again")
        return None
    return vocab.ids.numpy(), record


def recorded_vocab(out: Path) -> dict | None:
    """run.json's draft_vocab record, None where there is no readable one."""
    try:
        record = read_run_record(out).draft_vocab
    except PipelineError:
        return None
    return record if isinstance(record, dict) else None
