"""`pipeline generate`'s options, each declared once: the field is the flag, its default and its help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import option
from stages.options import Device, JsonOutput, Seeded, ShardSelection


@dataclass(kw_only=True)
class GenerateOptions(Device, Seeded, ShardSelection, JsonOutput):
    # The shared --seed and --shards, as generate means them.
    OWN_HELP = {"seed": "Sampling seed; each turn draws from its own generator seeded by (seed, row, turn).",
                "shards": "Shards this invocation writes, e.g. '0-7' (default: all)."}

    data: list[str] = option(help="Conversations to regenerate (JSONL/Parquet, `messages` or `conversations`, or embedded:train / embedded:heldout). Repeatable.")
    out: Path = option(help="Output JSONL (messages format, reasoning and tool calls as fields); work in progress lives in OUT.parts/ until every shard is done.")
    target: str | None = option(None, help="Target model directory (default: the embedded tiny target). With --server: its tokenizer checks the server's.")
    server: str | None = option(None, help="An OpenAI-compatible server (e.g. http://127.0.0.1:8000) instead of the target in this process.")
    model: str | None = option(None, help="The server's model name (default: the one it serves).")
    concurrency: int = option(8, help="Requests in flight to the server at most.")
    num_shards: int | None = option(None, help="Shard count (default: one per 256 rows); the unit of resumption.")
    turns: str = option("all", help="'all' assistant turns in order (later ones see the regenerated earlier ones) or only the 'last'.")
    max_new_tokens: int = option(512, help="Tokens per turn at most; a turn that does not end by then drops its row (counted).")
    temperature: float = option(0.0, help="0 = greedy; > 0: each turn draws from its own generator seeded by (--seed, row, turn).")
    top_p: float = option(1.0, help="Nucleus sampling mass (with --temperature > 0).")
    batch_size: int = option(16, help="Turns generated together (one target pass per token for all).")
    on_error: str = option("fail", help="'fail' (default: stop at the first row that cannot be parsed or rendered, naming its file:line and turn) or 'skip' such rows (each one warning line, counted).")
