"""Write the odd prompts (pipeline/eval/odd_prompts.py) as JSONL for `pipeline eval --prompts`.

    python benchmarks/decoding/odd_prompts.py --out odd.jsonl
    pipeline eval --drafter RUN --prompts odd.jsonl --tree-budget 16,64 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.eval.odd_prompts import odd_conversations  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write (its folder must exist)")
    args = parser.parse_args()
    if args.out.is_dir() or not args.out.parent.is_dir():  # one line, not a traceback from write_text
        parser.error(f"--out must be a file in an existing folder, got {args.out}")
    rows = odd_conversations()
    args.out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"{len(rows)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
