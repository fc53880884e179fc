"""One cached sample made readable (`pipeline verify-cache --show ID`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.cache.reader import open_cache
from pipeline.cache.schema import INPUT_IDS, LOSS_MASK, SAMPLE_ID, TARGET_ARGMAX
from pipeline.data.loss_mask import token_kinds
from pipeline.errors import PipelineError
from pipeline.target_model import load_tokenizer, recorded_in_cache, resolve_target


def show_sample(cache_dir: str | Path, sample_id: int, target: Path | None) -> dict:
    """The sample as `--show` prints it: its tokens decoded one by one, each one's kind
    (reasoning, content, tool call, end of turn; '' = not supervised), loss mask and label (the
    target's argmax at the position before, DESIGN 3.2), and a one-line span summary."""
    reader = open_cache(cache_dir, foreign="report")  # looking at a sample of a mixed cache is how one inspects it
    shard = reader.find(sample_id)
    try:
        target_dir = resolve_target(target, recorded_in_cache(reader.manifest))
    except PipelineError as e:
        raise PipelineError(f"--show needs the target's tokenizer: {e}") from None
    tokenizer = load_tokenizer(target_dir)
    ids, mask = shard.read(INPUT_IDS, sample_id).tolist(), shard.read(LOSS_MASK, sample_id).tolist()
    argmax = shard.read(TARGET_ARGMAX, sample_id).tolist()
    pieces = [tokenizer.decode([token]) for token in ids]
    ends = np.cumsum([len(p) for p in pieces])
    offsets = np.stack([ends - [len(p) for p in pieces], ends], axis=1) if pieces else np.zeros((0, 2), dtype=np.int64)
    kinds = token_kinds("".join(pieces), offsets, mask, reader.manifest.identity.tokenizer.end_of_turn)
    supervised = [i for i, m in enumerate(mask) if m]
    by_kind = ", ".join(f"{kinds.count(k)} {k.replace('_', ' ')}" for k in ("reasoning", "content", "tool_call", "end_of_turn"))
    header = (f"sample {sample_id} ({shard.name}): {len(ids)} tokens, {len(supervised)} supervised ({by_kind}), "
              f"first {supervised[0] if supervised else None}, last {supervised[-1] if supervised else None}")
    return {SAMPLE_ID: sample_id, "shard": shard.name, "summary": header, INPUT_IDS: ids, LOSS_MASK: mask,
            "labels": [None, *argmax[:-1]], "pieces": pieces, "kinds": kinds}
