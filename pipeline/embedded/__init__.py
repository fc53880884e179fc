"""The embedded default: the tiny trained Qwen3.5-architecture target and its dataset.

Built by `python -m pipeline.toy.build` (see pipeline/toy/build.py) and shipped inside the
package, so every command runs offline without arguments pointing elsewhere.
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent
TARGET_DIR = EMBEDDED_DIR / "target"
DATA_DIR = EMBEDDED_DIR / "data"
TRAIN_DATA = DATA_DIR / "train.jsonl"
HELDOUT_DATA = DATA_DIR / "heldout.jsonl"
BUILD_REPORT = EMBEDDED_DIR / "build.json"
