"""Every cache array is named through the schema (pipeline/cache/schema.py: INPUT_IDS, HIDDEN, ...):
the library, the stages and the test kit never spell an array's name as a string of their own, so
renaming or adding an array is one edit there. The tests may spell the on-disk names: there they
are an independent reference of the format, and so may the benchmarks (measurements, not the
product: they build arrays and rows of their own to time).

The exceptions are listed below, each with its reason; one whose reason is gone fails too."""

from __future__ import annotations

import ast
from pathlib import Path

from pipeline.cache.schema import HIDDEN_FORMATS, array_specs

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("pipeline", "stages", "harness")
SCHEMA = "pipeline/cache/schema.py"  # where the names are defined

ARRAY_NAMES = {spec.name for hidden_format in HIDDEN_FORMATS for spec in array_specs(hidden_format)}

TOKENIZER_OUTPUT = "the key of a Hugging Face tokenizer's output, not the cache's array"
# (file, name) -> why that file may spell that name.
EXEMPT = {
    ("harness/caches.py", name): "the test kit's independent spelling of the on-disk arrays (it reads caches "
                                 "without the pipeline's own parsers where a test is about them)"
    for name in ("input_ids", "loss_mask", "target_argmax", "target_topk_ids", "target_topk_logits",
                 "target_logsumexp", "hidden")
} | {
    ("pipeline/target_model/capture.py", name): "pipeline.target_model is a floor below pipeline.cache "
                                                "(tests/command_line/test_layers.py) and cannot import the schema; "
                                                "encode_rows refuses a capture that lacks a declared array"
    for name in ("hidden", "target_argmax", "target_topk_ids", "target_topk_logits", "target_logsumexp")
} | {
    ("pipeline/data/conversations.py", "input_ids"): "a field of a pre-tokenized dataset row (the dataset's format)",
    ("pipeline/data/conversations.py", "loss_mask"): "a field of a pre-tokenized dataset row (the dataset's format)",
    ("pipeline/data/loss_mask.py", "input_ids"): TOKENIZER_OUTPUT,
    ("pipeline/data/prompts.py", "input_ids"): TOKENIZER_OUTPUT,
    ("pipeline/generate/in_process.py", "input_ids"): TOKENIZER_OUTPUT,
    ("pipeline/generate/server.py", "input_ids"): TOKENIZER_OUTPUT,
    ("pipeline/toy/generate.py", "input_ids"): TOKENIZER_OUTPUT,
    ("harness/chat_shapes.py", "input_ids"): TOKENIZER_OUTPUT,
}


def check_names(tree: ast.AST) -> set[int]:
    """ids of the string constants that name a verify check (`Check("loss_mask", ...)`): a key of
    verify-cache's report, named after the array it checks, not the array itself."""
    return {id(node.args[0]) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Check" and node.args}


def spelled_names(rel: str, source: str) -> list[tuple[int, str]]:
    """(line, name) of every string constant in the source that equals a cache array's name."""
    tree = ast.parse(source, filename=rel)
    checks = check_names(tree)
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in ARRAY_NAMES and id(node) not in checks)


def scanned_files() -> list[str]:
    return [p.relative_to(ROOT).as_posix() for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))
            if p.relative_to(ROOT).as_posix() != SCHEMA]


def test_code_names_cache_arrays_through_the_schema():
    offenders, used = [], set()
    for rel in scanned_files():
        for line, name in spelled_names(rel, (ROOT / rel).read_text(encoding="utf-8")):
            if (rel, name) in EXEMPT:
                used.add((rel, name))
            else:
                offenders.append(f"{rel}:{line} spells the cache array {name!r}: use the schema's constant "
                                 f"(from pipeline.cache.schema import ...)")
    stale = [f"{rel}: exempt for {name!r} but no longer spells it ({EXEMPT[rel, name]})"
             for rel, name in sorted(set(EXEMPT) - used)]
    assert not offenders and not stale, "\n".join(offenders + stale)


def test_the_scan_sees_what_it_forbids():
    """Subscripts, dict keys and arguments are caught; a check's name and other strings are not."""
    source = ('x = s["input_ids"]\ny = {"hidden": 1}\nz = read("offsets")\nc = Check("loss_mask", True, "ok")\n'
              'w = "input_ids differ"\n')
    assert spelled_names("sample.py", source) == [(1, "input_ids"), (2, "hidden"), (3, "offsets")]
