"""Per-sample checks of the loss masks (DESIGN 3.5, 10), over every sample of the given shards.

`check_mask_boundaries` needs only the tokenizer's chat tokens: headers and non-assistant turns
unsupervised, each supervised assistant turn closed by a supervised end-of-turn. `check_loss_masks`
re-derives every sample from the dataset the manifest names with the same rule extract applied.
Samples are read in windows of whole samples (a handful of reads per window).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.verify.bounded_reads import shard_tokens, sound_shards
from pipeline.verify.check_report import Check, SampleList
from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import INPUT_IDS, LOSS_MASK
from pipeline.data.conversations import index_rows, iter_rows
from pipeline.data.loss_mask import ConversationMasker, mask_violations, newline_tokens
from pipeline.data.samples import row_tokens
from pipeline.errors import PipelineError
from pipeline.provenance import sha256_file


def check_loss_masks(reader: CacheReader, shards: list[str], tokenizer) -> Check:
    """Re-derive every sample of the shards from the dataset the manifest names, with its chat
    template, mode and reasoning policy: the same rule extract applied (DESIGN 3.5, 10)."""
    identity = reader.manifest.identity
    paths = [Path(p) for p in reader.manifest.sources.data]
    if not paths or not all(p.is_file() for p in paths):
        return Check("loss_mask", True, "skipped: the dataset the manifest names is not readable here", skipped=True)
    if [sha256_file(p) for p in paths] != [f["sha256"] for f in identity.data.files]:
        return Check("loss_mask", False, "the dataset files differ from the ones the cache was made with (sha256)")
    recorded = identity.tokenizer
    max_length = identity.capture.max_length
    masker = ConversationMasker(tokenizer, recorded.end_of_turn, recorded.chat_template_kwargs, recorded.reasoning)
    index, _ = index_rows(paths, on_error="skip")
    mismatched, checked = SampleList(), 0
    for name, shard in sound_shards(reader, shards):
        rows = {r.sample_id: r for r in iter_rows(paths, on_error="skip", wanted=set(shard.sample_ids.tolist()), index=index)
                if not isinstance(r, PipelineError)}
        try:
            for _, sid, stored in shard_tokens(shard):
                checked += 1
                row = rows.get(sid)
                if row is None:
                    mismatched.add(name, sid, "row not readable in the dataset")
                    continue
                try:
                    ids, mask, _ = row_tokens(row, masker)  # extract's own rule (pipeline/data/samples.py)
                except PipelineError as e:
                    mismatched.add(name, sid, f"cannot be re-derived ({e})")
                    continue
                ids, mask = ids[:max_length], mask[:max_length]
                if stored[INPUT_IDS].tolist() != ids:
                    mismatched.add(name, sid, f"{row.where}: input_ids differ from re-tokenization")
                elif (stored_mask := stored[LOSS_MASK].tolist()) != mask:
                    at = next(i for i, (x, y) in enumerate(zip(stored_mask, mask)) if x != y)
                    mismatched.add(name, sid, f"{row.where}: loss_mask differs first at position {at}")
        except PipelineError:
            continue  # an undecodable chunk: reported by the checksum check
    return Check("loss_mask", not mismatched,
                 f"{checked} samples re-derived from the chat template"
                 + (f": {mismatched.describe()} differ" if mismatched else ": identical"),
                 {"samples": checked, **mismatched.evidence()})


def check_mask_boundaries(reader: CacheReader, shards: list[str], tokenizer) -> Check:
    """Every stored mask obeys the rule (no dataset needed, only the tokenizer's chat tokens)."""
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" not in vocab:
        return Check("mask_boundaries", True, "skipped: the tokenizer has no <|im_start|> turn marker", skipped=True)
    end = reader.manifest.identity.tokenizer.end_of_turn
    newline = newline_tokens(tokenizer, reader.manifest.identity.capture.vocab_size)
    kinds: dict[str, SampleList] = {}
    checked = 0
    for name, shard in sound_shards(reader, shards):
        try:
            for _, sid, stored in shard_tokens(shard):
                checked += 1
                found = mask_violations(stored[INPUT_IDS], stored[LOSS_MASK], turn_start=vocab["<|im_start|>"],
                                        end_of_turn=vocab[end], newline=newline, decode=tokenizer.decode)
                for kind, pos in found.items():
                    kinds.setdefault(kind, SampleList()).add(name, sid, f"position {pos}")
        except PipelineError:
            continue  # reported by the checksum check
    summary = (f"{checked} samples: headers, system/user/tool turns unsupervised; {end} supervised" if not kinds else
               f"{checked} samples: " + "; ".join(f"{kind} ({found.describe()})" for kind, found in kinds.items()))
    return Check("mask_boundaries", not kinds, summary,
                 {"samples": checked, "violations": {k: v.evidence() for k, v in kinds.items()}})
