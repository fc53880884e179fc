"""`pipeline verify-cache`'s options, each declared once: the field is the flag, its default and its help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import option
from stages.options import Device, JsonOutput, Seeded, ShardSelection


@dataclass(kw_only=True)
class VerifyOptions(Device, Seeded, ShardSelection, JsonOutput):
    # The shared --seed, --device and --dtype, as verify-cache means them: the target runs only for
    # the model checks (--tail-rate, --recompute).
    OWN_HELP = {"seed": "Seed for the sampled chunks and samples (--sample-rate, --tail-rate, --recompute).",
                "device": "Where the model checks run: 'auto' (the GPU when there is one), 'cpu', 'cuda' or 'cuda:N'.",
                "dtype": "Model dtype for the checks: 'auto' (bfloat16 on a GPU, float32 on the CPU), 'float32' or 'bfloat16'."}

    cache: str = option(argument=True, help="Cache to verify: a directory, file://PATH or s3://BUCKET/PREFIX.")
    target: Path | None = option(None, help="Target directory (default: the one the manifest records, if present).")
    recompute: int = option(0, help="Samples to re-run through --target from the embeddings and compare tap by tap: one of every shard, the longest and the truncated ones first, then random ones.")
    tail_rate: float = option(1.0, help="Fraction of samples whose stored deepest tap is run through the layers after it, the final norm and the lm_head and compared with the stored predictions (default: every sample; 0: off).")
    sample_rate: float = option(1.0, help="Fraction of chunks whose checksums are verified (--seed picks them, and the sampled samples).")
    show: int | None = option(None, help="Print this sample decoded, supervised reasoning, content, tool-call and end-of-turn tokens coloured apart on a terminal, tagged [[R ...]] [[C ...]] [[T ...]] [[E ...]] when piped; with --json its tokens, labels, loss mask and kinds are in the document.")
