"""Reasoning-and-tools conversations through `pipeline extract`: what gets supervised.

    python benchmarks/cache/conversations.py --template PATH/qwen3.6.jinja [--rows 60] [--out DIR] [--json]

Writes a deterministic dataset of agent conversations (arithmetic and lookups answered with
reasoning, tool calls and tool replies, some multi-turn, some ending in a tool call), extracts it
with the embedded tiny target under the given real chat template (thinking on), and reports per
row the tokens, the supervised tokens and how many of them are reasoning and tool calls, plus the
manifest's totals (reasoning share). `--data-only` only writes the dataset, so another version of
the pipeline can extract the very same rows for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                                     "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "lookup", "description": "Spell a word letter by letter",
                                      "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}},
]
WORDS = ["river", "cloud", "stone", "amber", "maple", "ocean", "tiger", "piano"]


def tool_call(name: str, arguments: dict) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def conversation(rng: random.Random, k: int) -> dict:
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    word = rng.choice(WORDS)
    spelled = "-".join(word)
    kind = k % 4
    if kind == 0:  # reasoning only
        messages = [{"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "reasoning_content": f"I add {a} and {b}. {a} plus {b} is {a + b}.",
                     "content": f"{a} plus {b} is {a + b}."}]
    elif kind == 1:  # reasoning, tool call, reply, answer
        messages = [{"role": "user", "content": f"Use the tool: what is {a} plus {b}?"},
                    {"role": "assistant", "reasoning_content": "The user wants the tool. I call add.", "content": None,
                     "tool_calls": [tool_call("add", {"a": a, "b": b})]},
                    {"role": "tool", "tool_call_id": "call_1", "content": str(a + b)},
                    {"role": "assistant", "reasoning_content": f"The tool returned {a + b}.", "content": f"The sum is {a + b}."}]
    elif kind == 2:  # tool exchange, then a new question
        messages = [{"role": "system", "content": "You are a careful assistant."},
                    {"role": "user", "content": f"Spell {word} with the tool."},
                    {"role": "assistant", "reasoning_content": "I call lookup.", "content": "Let me look it up.",
                     "tool_calls": [tool_call("lookup", {"word": word})]},
                    {"role": "tool", "tool_call_id": "call_1", "content": spelled},
                    {"role": "assistant", "reasoning_content": "The tool spelled it.", "content": f"{word} is spelled {spelled}."},
                    {"role": "user", "content": f"And {a} plus {b}?"},
                    {"role": "assistant", "reasoning_content": f"{a} plus {b} is {a + b}.", "content": f"{a + b}."}]
    else:  # ends in a tool call
        messages = [{"role": "user", "content": f"What is {a} plus {b}? Use the tool."},
                    {"role": "assistant", "reasoning_content": "I will call add.", "content": None,
                     "tool_calls": [tool_call("add", {"a": a, "b": b})]}]
    row = {"messages": messages, "generated_by": "hand-written (benchmarks/conversations.py)"}
    if kind:
        row["tools"] = TOOLS
    return row


def exchange(rng: random.Random, k: int) -> list[dict]:
    """One user request and the assistant's whole answer to it (reasoning, tool calls and their
    replies): a piece of a longer agent session."""
    a, b, c = rng.randint(2, 900), rng.randint(2, 900), rng.randint(2, 9)
    word = rng.choice(WORDS)
    spelled = "-".join(word)
    if k % 3 == 0:
        return [{"role": "user", "content": f"What is {a} plus {b}, times {c}? Use the tool for the sum."},
                {"role": "assistant", "reasoning_content": f"The user asks for ({a} + {b}) x {c}. The add tool gives the "
                 f"sum; I multiply by {c} myself afterwards. First the sum.", "content": None,
                 "tool_calls": [tool_call("add", {"a": a, "b": b})]},
                {"role": "tool", "tool_call_id": "call_1", "content": str(a + b)},
                {"role": "assistant", "reasoning_content": f"The tool says {a} + {b} = {a + b}. Times {c}: {a + b} x {c} = "
                 f"{(a + b) * c}. I check: {(a + b) * c} / {c} = {a + b}. Correct.",
                 "content": f"({a} + {b}) x {c} = {a + b} x {c} = {(a + b) * c}."}]
    if k % 3 == 1:
        return [{"role": "user", "content": f"Spell '{word}' with the tool, then tell me how many letters it has."},
                {"role": "assistant", "reasoning_content": f"I call lookup for '{word}', then count the letters it returns.",
                 "content": "Let me look it up.", "tool_calls": [tool_call("lookup", {"word": word})]},
                {"role": "tool", "tool_call_id": "call_1", "content": spelled},
                {"role": "assistant", "reasoning_content": f"The tool spelled {spelled}: that is {len(word)} letters, "
                 f"separated by {len(word) - 1} hyphens.", "content": f"'{word}' is spelled {spelled}; it has {len(word)} letters."}]
    return [{"role": "user", "content": f"Without tools: is {a} larger than {b}, and by how much?"},
            {"role": "assistant", "reasoning_content": f"I compare {a} and {b}. The difference is {abs(a - b)}, so "
             f"{max(a, b)} is the larger one" + (" (they are equal)" if a == b else "") + ".",
             "content": f"{max(a, b)} is larger by {abs(a - b)}." if a != b else f"They are equal: {a}."}]


def session(rng: random.Random, exchanges: int) -> dict:
    """A long agent session: a system prompt with the tools, then `exchanges` requests answered
    in turn (as an agent's transcript grows)."""
    messages = [{"role": "system", "content": "You are a careful assistant. Use the tools when asked; show your "
                 "arithmetic when you do it yourself."}]
    for k in range(exchanges):
        messages += exchange(rng, k)
    return {"messages": messages, "tools": TOOLS, "generated_by": "hand-written (benchmarks/conversations.py)"}


def write_sessions(path: Path, rows: int, count_tokens, *, shortest: int = 300, longest: int = 2000,
                   seed: int = 0) -> Path:
    """`rows` agent sessions whose lengths (`count_tokens(row)`, tokens with the real template)
    are spread from about `shortest` to about `longest`: each grows by one exchange until it
    reaches its target."""
    rng = random.Random(seed)
    targets = [shortest + (longest - shortest) * i // max(rows - 1, 1) for i in range(rows)]
    with open(path, "w", encoding="utf-8") as f:
        for target in targets:
            exchanges = 1
            while True:
                state = rng.getstate()
                row = session(rng, exchanges)
                if count_tokens(row) >= target or exchanges >= 200:
                    break
                rng.setstate(state)
                exchanges += 1
            f.write(json.dumps(row) + "\n")
    return path


def write_dataset(path: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for k in range(rows):
            f.write(json.dumps(conversation(rng, k)) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", type=Path, required=True, help="a real chat template (.jinja)")
    parser.add_argument("--rows", type=int, default=60, help="conversations in the dataset (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="keep the dataset, target and cache here (default: a new temporary folder)")
    parser.add_argument("--data-only", action="store_true", help="only write the dataset and print its path")
    parser.add_argument("--json", action="store_true", help="print the result, per-row counts included, as JSON")
    args = parser.parse_args()
    # Bad values end here in one line, not in a traceback after the dataset is written.
    if not args.data_only and not args.template.is_file():
        parser.error(f"--template: no such file: {args.template}")
    if args.rows < 1:
        parser.error(f"--rows must be at least 1, got {args.rows}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out must be a folder, not a file: {args.out}")

    out = args.out or Path(tempfile.mkdtemp(prefix="dflash-conversations-"))
    out.mkdir(parents=True, exist_ok=True)
    data = write_dataset(out / "agent.jsonl", args.rows)
    if args.data_only:
        print(data)
        return

    from pipeline.cache.reader import CacheReader
    from pipeline.config import ExtractConfig
    from pipeline.embedded import TARGET_DIR
    from stages.extract.run import run_extract

    target = out / "target"
    if not target.exists():
        shutil.copytree(TARGET_DIR, target)
    (target / "chat_template.jinja").write_text(args.template.read_text())
    cache = out / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    summary = run_extract(ExtractConfig(target=str(target), data=[str(data)], cache=str(cache), num_shards=1,
                                        max_length=100_000), None, progress=False)
    reader = CacheReader(cache)
    shard = reader.shard(reader.shards[0])
    per_row = [{"sample_id": int(sid), "tokens": int(len(shard.read("loss_mask", int(sid)))),
                "supervised": int(shard.read("loss_mask", int(sid)).sum())} for sid in shard.sample_ids]
    counts = reader.manifest.shards[reader.shards[0]].counts
    result = {"template": args.template.name, "rows": args.rows, "samples": summary["samples"],
              "supervised_tokens": counts["supervised_tokens"], "reasoning_tokens": counts["reasoning_tokens"],
              "tool_call_tokens": counts["tool_call_tokens"], "reasoning_share": summary["reasoning_share"],
              "rows_with_reasoning": counts["rows_with_reasoning"], "rows_with_tool_calls": counts["rows_with_tool_calls"],
              "rows_with_tool_replies": counts["rows_with_tool_replies"],
              "reasoning_turns_not_rendered": counts["reasoning_turns_not_rendered"],
              "supervised_per_row": sum(r["supervised"] for r in per_row) / len(per_row),
              "per_row": per_row}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            if key != "per_row":
                print(f"{key:>30}: {value}")


if __name__ == "__main__":
    main()
