"""Choosing a draft vocabulary from the cache (DESIGN 3.4, `pipeline train --draft-vocab K`).

Which tokens: the K the target predicts most often where the drafter is trained on its
predictions, i.e. its stored argmax at position t-1 for every supervised position t (loss_mask[t]
= 1, t inside the sample's first max_length tokens): exactly the labels training reads, counted in
one pass over the `target_argmax` and `loss_mask` arrays. Ties in the count are broken by the
smaller token id, so a cache and K decide the vocabulary.

Always in, whatever their count (a vocabulary must never lose them):
- every reserved token of the tokenizer (special or added: end of turn and end of text, the think
  and tool-call markers, ...) but the mask token: the ones the target emits in serving are among
  them, and one cache cannot say which (a data set without tool calls never shows `<tool_call>`);
- the tokenizer's byte-level fallback tokens (the 256 single-byte tokens of a byte-level BPE),
  so that any text stays writable (a frequency-only choice once dropped them and hurt non-English
  output), when K >= BYTES_FROM (below that the 256 bytes would be an eighth or more of the
  vocabulary; the record says they were not reserved).

A label outside the vocabulary cannot be drafted: the slot is left out of the loss (EAGLE-3's and
speculators' rule: their position mask drops targets outside the draft vocabulary) and counted in
the metrics as a miss (a slot the drafter cannot get accepted), and its share is logged as
`outside_vocab`. The run records the set's size, digest, coverage and what was reserved. Which
rank counts, and what a resume reuses instead: pipeline/training/run_vocab.py.
"""

from __future__ import annotations

import numpy as np

from pipeline.cache.schema import LOSS_MASK, TARGET_ARGMAX
from pipeline.drafter.vocab import DraftVocab
from pipeline.errors import PipelineError

BYTES_FROM = 8 * 256
OUTSIDE_RULE = ("a label outside the draft vocabulary is left out of the loss (EAGLE-3, speculators) "
                "and counted in the metrics as a miss")
# Tokens read at a time from one shard (cut at a sample boundary): two int32 arrays of this many.
_WINDOW = 1 << 24


def count_labels(reader, vocab_size: int, max_length: int, shards: list[str] | None = None) -> np.ndarray:
    """[V] int64: how often each token is the label of a supervised slot (target_argmax[t-1] for
    loss_mask[t] = 1, t < max_length inside its sample), over `shards` (default: all)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for name in shards if shards is not None else reader.shards:
        shard = reader.shard(name)
        offsets = np.asarray(shard.offsets, dtype=np.int64)
        first = 0
        while first < len(offsets) - 1:
            last = first + 1  # samples [first, last) read together: at least one, at most about _WINDOW tokens
            while last < len(offsets) - 1 and offsets[last + 1] - offsets[first] <= _WINDOW:
                last += 1
            a, b = int(offsets[first]), int(offsets[last])
            argmax = np.asarray(shard.read_range(TARGET_ARGMAX, a, b), dtype=np.int64)
            mask = np.asarray(shard.read_range(LOSS_MASK, a, b)) != 0
            starts = offsets[first:last] - a
            local = np.arange(b - a) - np.repeat(starts, np.diff(offsets[first:last + 1]))  # position inside its sample
            supervised = mask & (local >= 1) & (local < max_length)
            labels = argmax[np.flatnonzero(supervised) - 1]
            if len(labels) and (labels.min() < 0 or labels.max() >= vocab_size):
                raise PipelineError(f"{shard.path}/{TARGET_ARGMAX}: a label outside [0, {vocab_size})")
            counts += np.bincount(labels, minlength=vocab_size)
            first = last
    return counts


def reserved_ids(tokenizer, *, mask_id: int, vocab_size: int, size: int) -> dict[str, list[int]]:
    """{"reserved": ids, "bytes": ids} that a vocabulary of `size` keeps whatever their count."""
    from tokenizers.pre_tokenizers import ByteLevel

    from pipeline.target_model import reserved_token_ids

    special = sorted(i for i in reserved_token_ids(tokenizer) | {tokenizer.eos_token_id}
                     if isinstance(i, int) and 0 <= i < vocab_size and i != mask_id)
    found = []
    if size >= BYTES_FROM:
        vocab = tokenizer.get_vocab()
        found = sorted({vocab[c] for c in ByteLevel.alphabet() if c in vocab and vocab[c] < vocab_size} - set(special))
    return {"reserved": special, "bytes": found}


def choose(counts: np.ndarray, size: int, keep: list[int]) -> np.ndarray:
    """The `size` ids: `keep`, then the most counted others (ties: the smaller id first), sorted."""
    keep = sorted(set(int(i) for i in keep))
    if len(keep) > size:
        raise PipelineError(f"--draft-vocab {size}: smaller than the {len(keep)} tokens a vocabulary keeps "
                            "(reserved tokens and byte fallbacks); choose a larger K")
    score = counts.astype(np.int64).copy()
    score[keep] = -1  # taken already
    rest = np.lexsort((np.arange(len(score)), -score))[:size - len(keep)]  # count descending, id ascending
    return np.sort(np.concatenate([np.asarray(keep, dtype=np.int64), rest.astype(np.int64)]))


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """The share of counted labels inside the vocabulary `ids`."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


def check_size(size: int, vocab_size: int) -> None:
    if not 8 <= size < vocab_size:
        # K = V is the whole vocabulary, what no --draft-vocab trains (and vLLM loads no d2t for it).
        raise PipelineError(f"--draft-vocab {size}: must be at least 8 and below the target's vocabulary of {vocab_size} "
                            "(for the whole vocabulary, leave --draft-vocab out)")


def vocab_from_counts(counts: np.ndarray, tokenizer, *, size: int, vocab_size: int, mask_id: int
                      ) -> tuple[np.ndarray, dict[str, list[int]]]:
    """(the sorted ids of a `size` vocabulary, what it kept whatever the counts) from label counts:
    the one rule `train --draft-vocab` and `cache-info --draft-vocab` share."""
    check_size(size, vocab_size)
    kept = reserved_ids(tokenizer, mask_id=mask_id, vocab_size=vocab_size, size=size)
    return choose(counts, size, kept["reserved"] + kept["bytes"]), kept


def choose_draft_vocab(reader, tokenizer, *, size: int, vocab_size: int, mask_id: int, max_length: int,
                       shards: list[str] | None = None) -> tuple[DraftVocab, dict]:
    """(the vocabulary, what run.json records of it) for `pipeline train --draft-vocab size`."""
    check_size(size, vocab_size)  # before the pass over the cache
    counts = count_labels(reader, vocab_size, max_length, shards)
    if not counts.sum():
        raise PipelineError(f"--draft-vocab: the cache {reader.location.where()} has no supervised label to count")
    ids, kept = vocab_from_counts(counts, tokenizer, size=size, vocab_size=vocab_size, mask_id=mask_id)
    vocab = DraftVocab(ids, vocab_size)
    record = {
        "size": size, "target_size": vocab_size, "sha256": vocab.digest(),
        "coverage": round(coverage(counts, ids), 6),
        "labels_counted": int(counts.sum()), "distinct_labels": int((counts > 0).sum()),
        "reserved": len(kept["reserved"]),
        "byte_fallbacks": len(kept["bytes"]) if size >= BYTES_FROM else f"not reserved (K < {BYTES_FROM})",
        "chosen_by": "the target's stored argmax on supervised positions; ties: smaller id first",
        "outside_rule": OUTSIDE_RULE,
    }
    return vocab, record
