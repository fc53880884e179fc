"""`pipeline eval`'s options, each declared once: the field is the flag, its default and its help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import int_list, option
from pipeline.tracking import TRACKERS
from stages.options import Device, JsonOutput, Seeded


@dataclass(kw_only=True)
class EvalOptions(Device, Seeded, JsonOutput):
    # The shared --seed and --dtype, as eval means them.
    OWN_HELP = {"seed": "Sampling: the seed; a prompt's random numbers depend on it and the prompt's index only, so --batch-size does not change the tokens.",
                "dtype": "Target and drafter dtype: 'auto' (bfloat16 on a GPU, float32 on the CPU), 'float32' or 'bfloat16'."}

    drafter: Path = option(Path("dflash-run"), help="Drafter export (RUN/drafter) or its run directory.")
    target: Path | None = option(None, help="Target model directory (default: the one the run trained against, else the embedded target).")
    prompts: Path | None = option(None, help="JSONL conversations; the prompt is everything before the last assistant turn (default: the embedded held-out set).")
    max_new_tokens: int = option(96, help="Tokens generated per prompt at most.")
    block_size: int | None = option(None, help="Draft block size (default: the drafter's).")
    tree_budget: list[int] = option(factory=lambda: [16, 64], parse=int_list, help="DDTree node budgets, comma-separated ('' for none).")
    tree_top_k: int = option(8, help="Candidates per draft position for DDTree.")
    report_to: str | None = option(None, help=f"Also send the figures (taus, tau_walk with --cache) to the training run's trackers, as eval/... at its last step: {', '.join(TRACKERS)}.")
    tree_verify: str = option("auto", help="How a DDTree is verified: 'auto' (by the target's size; recorded in the result), 'tree' (each node once: ancestor mask, per-node recurrent states; faster where the target's compute dominates) or 'paths' (root-to-leaf paths as batch rows; faster on tiny targets, and for attention implementations that take no mask).")
    batch_size: int = option(1, help="Prompts decoded together, one target pass per step for all of them, in every variant and in the plain reference (each prompt still checked against its own greedy tokens; sampled tokens do not change either: a prompt's random numbers depend on --seed and its index only); worth it on a GPU.")
    limit: int | None = option(None, help="Only the first N prompts.")
    cache: str | None = option(None, help="A cache (directory or s3://BUCKET/PREFIX) of the same conversations: also report the teacher-forced avg_streak + 1 on their last assistant turns.")
    group_by: str | None = option(None, help="Also report tau per value of this row field (e.g. category or source); tau per kind of turn (thinking, non-thinking, tool call) is always reported.")
    temperature: float = option(0.0, help="0: greedy (default). > 0: speculative sampling at this temperature (lossless in distribution; the baseline is plain sampling), the target's and the drafter's distributions warped alike.")
    top_p: float = option(1.0, help="Sampling: keep the most likely tokens whose mass reaches this (1: off).")
    top_k: int = option(0, help="Sampling: keep the K most likely tokens (0: off).")
    outputs: Path | None = option(None, help="Also write what was decoded, a JSON line per prompt: its number, kind of turn, the reference's and every variant's ids and text, each variant's accepted draft tokens per verify step and (greedy) where it departed from greedy, at a tie or not. Written as each batch of prompts finishes, to FILE.partial (tail -f it), renamed to FILE when every prompt is in.", metavar="FILE")
