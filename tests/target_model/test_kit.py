"""The tiny target kit is reproducible from its seed, and what ships is what was built."""

import hashlib
import json
import os

import pytest

from pipeline.toy import build


@pytest.fixture(scope="module")
def report(embedded):
    return json.loads(embedded.BUILD_REPORT.read_text())


def test_shipped_files_match_the_build_report(embedded, report):
    assert report["files"], "build report lists no files"
    for name, meta in report["files"].items():
        data = (embedded.EMBEDDED_DIR / name).read_bytes()
        assert len(data) == meta["bytes"], name
        assert hashlib.sha256(data).hexdigest() == meta["sha256"], name


def test_rebuilt_tokenizer_is_identical(embedded, report, tmp_path):
    tokenizer = build.build_tokenizer(report["seed"])
    tokenizer.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (embedded.TARGET_DIR / name).read_bytes(), name


def test_regenerated_dataset_is_identical(embedded, report, target, tokenizer, train_rows, heldout_rows):
    """Same seed, same (shipped) target: the dataset prompts and the target's greedy answers, its
    tool calls and the tools' replies come out exactly as shipped, for the first 100 drawn
    conversations of each split (suite time; the DFLASH_SLOW full rebuild below regenerates all)."""
    dataset, stats = build.build_dataset(target, tokenizer, seed=report["seed"], first=100, log=lambda *_: None)
    for split, shipped in (("train", train_rows), ("heldout", heldout_rows)):
        assert len(dataset[split]) >= 80 and dataset[split] == shipped[:len(dataset[split])], split
        assert 100 - len(dataset[split]) == stats[split]["dropped"] <= report["dataset_stats"][split]["dropped"]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DFLASH_SLOW") != "1", reason="rebuilds the whole kit (about 5 minutes); DFLASH_SLOW=1")
def test_full_rebuild_is_identical(embedded, report, tmp_path):
    fresh = build.build(tmp_path, seed=report["seed"], num_steps=report["train"]["num_steps"], log=lambda *_: None)
    for name, meta in report["files"].items():
        assert fresh["files"][name]["sha256"] == meta["sha256"], name


OPENAI_TOOL_KEYS = ("type", "function")
OPENAI_FUNCTION_KEYS = ("name", "description", "parameters")


def test_tool_schemas_keep_the_order_an_openai_server_sends(train_rows, heldout_rows, tokenizer):
    """The template renders a schema's keys in their order, and OpenAI-compatible servers (vLLM's
    pydantic request model) re-serialise each tool as type, function: name, description,
    parameters. A shipped row must keep that order, or the prompt a server generates from is not
    the one extract renders; and its prompt must be the one the target was trained on."""
    from pipeline.toy import chat, tasks

    with_tools = [row for row in train_rows + heldout_rows if row.get("tools")]
    assert len(with_tools) > 100
    for row in with_tools:
        for tool in row["tools"]:
            assert tuple(tool) == OPENAI_TOOL_KEYS, tool
            assert tuple(tool["function"]) == OPENAI_FUNCTION_KEYS, tool
        trained = [next(s for s in tasks.TOOL_SCHEMAS if s["function"]["name"] == t["function"]["name"])
                   for t in row["tools"]]
        first_user = [m["role"] for m in row["messages"]].index("user")
        prompt = row["messages"][:first_user + 1]
        assert chat.render(prompt, tools=row["tools"]) == chat.render(prompt, tools=trained)
