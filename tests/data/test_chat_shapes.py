"""Real Qwen3.x chat templates x thinking modes x conversation shapes: what `pipeline extract`
stores (real row parser, real target, real Zarr cache) against an oracle written from the rule
of DESIGN 3.5, token by token.

The oracle: render the template-ready messages with the template itself (transformers), find
each `<|im_start|>assistant\\n`, skip what the generation prompt supplies in that mode (a table
in harness/chat_shapes.py, read off each template's generation-prompt block), supervise up to and including
`<|im_end|>`; a token is supervised when any of its characters is. The rows given to extract are
written in the forms users have (arguments as JSON strings, `reasoning` instead of
`reasoning_content`, text parts), so the parser's normalisation is under test too.

Two tokenizers: the embedded one, and a variant made here from it that adds Qwen's `<think>`,
`</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` tokens and
merges `\\n\\n` into one token, as Qwen's does (so a token straddles `<think>\\n` + `\\n</think>`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.caches import manifest_json
from harness.chat_shapes import (END, MODES, QWEN_TOKENS, REASONING_SHAPES, SHAPES, TOOL_SHAPES, as_row, expected_outcome,
                                 oracle)
from harness.runs import REPO, cli, write_rows
from harness.prerequisites import needs
from pipeline.cache.reader import CacheReader
from pipeline.config import ExtractConfig
from pipeline.errors import PipelineError
from stages.extract.run import run_extract

TEMPLATES = REPO.parent / "shared" / "fixtures" / "chat_templates"
pytestmark = needs(TEMPLATES.is_dir(), f"real chat templates not found at {TEMPLATES} (the project's shared fixtures folder); "
                   "these tests need them")

def make_target(root: Path, template: str, variant: bool) -> Path:
    """The embedded target with a real Qwen template, and optionally the Qwen-like tokenizer."""
    from pipeline.embedded import TARGET_DIR
    out = root / f"{template}-{'qwen_tokens' if variant else 'embedded'}"
    if out.exists():
        return out
    shutil.copytree(TARGET_DIR, out)
    (out / "chat_template.jinja").write_text((TEMPLATES / f"{template}.jinja").read_text())
    if variant:
        spec = json.loads((out / "tokenizer.json").read_text())
        vocab = spec["model"]["vocab"]
        next_id = max(vocab.values()) + 1
        vocab["ĊĊ"] = next_id                       # byte-level "\n\n", and the merge that makes it
        spec["model"]["merges"].append(["Ċ", "Ċ"])
        for k, content in enumerate(QWEN_TOKENS, start=next_id + 1):  # added, not special: decoded as text
            vocab[content] = k
            spec["added_tokens"].append({"id": k, "content": content, "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": False})
        (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return out


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {(t, v): make_target(root, t, v) for t in ("qwen3", "qwen3.5", "qwen3.6") for v in (False, True)}


def test_variant_tokenizer_merges_like_qwen(targets):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(targets[("qwen3.6", True)])
    ids = tok("<think>\n\n</think>\n\nhi", add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[:4] == ["<think>", "\n\n", "</think>", "\n\n"], pieces
    assert max(ids) < 512, "fits the embedded target's embedding rows"


def extract_cases(tmp: Path, target: Path, template: str, mode: str, shapes: list[str], **extra):
    kwargs, _ = MODES[(template, mode)]
    data = write_rows(tmp / "rows.jsonl", [as_row(s) for s in shapes])
    cfg = ExtractConfig(target=str(target), data=[str(data)], cache=str(tmp / "cache"), num_shards=1,
                        chat_template_kwargs=kwargs, **extra)
    return run_extract(cfg, None, progress=False), CacheReader(tmp / "cache")


@pytest.mark.parametrize("variant", [False, True], ids=["embedded_tokenizer", "qwen_tokenizer"])
@pytest.mark.parametrize("template, mode", list(MODES), ids=[f"{t}-{m}" for t, m in MODES])
def test_stored_mask_equals_the_oracle(tmp_path, targets, template, mode, variant):
    from transformers import AutoTokenizer
    target = targets[(template, variant)]
    tokenizer = AutoTokenizer.from_pretrained(target)
    kwargs, supplied = MODES[(template, mode)]
    stored = [s for s in SHAPES if expected_outcome(template, mode, s) == "stored"]
    summary, reader = extract_cases(tmp_path, target, template, mode, stored)
    assert summary["samples"] == len(stored), summary
    shard = reader.shard(reader.shards[0])
    for sid, shape in enumerate(stored):
        ids, mask = oracle(tokenizer, shape, kwargs, supplied)
        got_ids, got_mask = shard.read("input_ids", sid).tolist(), shard.read("loss_mask", sid).tolist()
        assert got_ids == ids, (shape, "input_ids")
        assert got_mask == mask, (shape, [tokenizer.decode([i]) for i, m in zip(ids, mask) if m],
                                  [tokenizer.decode([i]) for i, m in zip(got_ids, got_mask) if m])
        # Never vacuous: every shape supervises each assistant turn's end-of-turn token.
        end_id = tokenizer.convert_tokens_to_ids(END)
        assert sum(m for i, m in zip(got_ids, got_mask) if i == end_id) == \
            sum(msg["role"] == "assistant" for msg in SHAPES[shape])
    counts = manifest_json(reader.dir)["shards"][reader.shards[0]]["counts"]
    assert counts["rows_with_tool_calls"] == len(TOOL_SHAPES & set(stored))
    assert counts["rows_with_tool_replies"] == len({"tool_reply_answer", "tool_then_question", "tool_with_reasoning"} & set(stored))
    assert counts["rows_with_reasoning"] == len(REASONING_SHAPES & set(stored))
    # Each refused shape is one error naming the row, raised before any manifest is written.
    for shape in (s for s in SHAPES if s not in stored):
        bad = tmp_path / shape
        bad.mkdir()
        with pytest.raises(PipelineError) as e:
            extract_cases(bad, target, template, mode, ["single_turn", shape])
        message = str(e.value)
        assert "\n" not in message and f"{bad / 'rows.jsonl'}:2:" in message, message
        want = "thinking is off" if expected_outcome(template, mode, shape) == "reasoning refused" else "the chat template refuses this row ("
        assert want in message, message
        assert not (bad / "cache" / "manifest.json").exists()


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_reasoning_with_thinking_off_by_policy(tmp_path, targets, policy):
    """drop: stored as if the rows had no reasoning (the oracle on stripped messages); keep: the
    reasoning is supervised in every turn that renders it, the `<think>\\n` opener given."""
    from transformers import AutoTokenizer
    target = targets[("qwen3.5", True)]
    tokenizer = AutoTokenizer.from_pretrained(target)
    kwargs, supplied = MODES[("qwen3.5", "no_thinking")]
    shapes = ["reasoning_last", "reasoning_in_both", "think_inline"]
    summary, reader = extract_cases(tmp_path, target, "qwen3.5", "no_thinking", shapes, reasoning=policy)
    shard = reader.shard(reader.shards[0])
    for sid, shape in enumerate(shapes):
        got = [tokenizer.decode([i]) for i, m in zip(shard.read("input_ids", sid).tolist(),
                                                      shard.read("loss_mask", sid).tolist()) if m]
        answers = [m for m in SHAPES[shape] if m["role"] == "assistant"]
        if policy == "drop":
            stripped = {**SHAPES[shape][-1], "content": SHAPES[shape][-1]["content"].split("</think>")[-1].lstrip("\n")}
            stripped.pop("reasoning_content", None)
            assert "".join(got).count("</think>") == 0, (shape, got)
            assert "".join(got).endswith(stripped["content"] + END), (shape, got)
        else:
            text = "".join(got)
            reasoning = [a.get("reasoning_content") or a["content"].split("</think>")[0].split("<think>")[-1].strip()
                         for a in answers]
            # Qwen3.5 renders reasoning in every turn that has it: each is supervised, opener excluded.
            for r in reasoning:
                assert r in text, (shape, r, text)
            assert not text.startswith("<think>"), (shape, text)
    key = "reasoning_turns_dropped" if policy == "drop" else "reasoning_tokens"
    assert summary[key] > 0 and summary["rows_with_reasoning"] == len(shapes)
    assert (summary["reasoning_share"] or 0) > 0 if policy == "keep" else summary["reasoning_share"] == 0


def test_reasoning_share_and_sources_in_the_manifest(tmp_path, targets):
    """Counted per shard: reasoning tokens are exactly the supervised tokens up to `</think>`."""
    from transformers import AutoTokenizer
    target = targets[("qwen3.6", True)]
    tokenizer = AutoTokenizer.from_pretrained(target)
    shapes = ["reasoning_last", "tool_with_reasoning", "single_turn"]
    rows = [as_row(s) for s in shapes]
    rows[0]["generated_by"] = "the target, greedy"
    data = write_rows(tmp_path / "rows.jsonl", rows)
    summary = run_extract(ExtractConfig(target=str(target), data=[str(data)], cache=str(tmp_path / "cache"), num_shards=1,
                                        generated_by="hand-written"), None, progress=False)
    reader = CacheReader(tmp_path / "cache")
    shard = reader.shard(reader.shards[0])
    want_reasoning = 0
    for sid in range(len(shapes)):
        ids, mask = shard.read("input_ids", sid).tolist(), shard.read("loss_mask", sid).tolist()
        turn = []
        for i, m in zip(ids, mask):
            if not m:
                if turn:  # a turn ended: its tokens through "</think>" are reasoning
                    pieces = [tokenizer.decode([t]) for t in turn]
                    if "</think>" in pieces:
                        want_reasoning += pieces.index("</think>") + 1
                turn = []
                continue
            turn.append(i)
    counts = manifest_json(reader.dir)["shards"][reader.shards[0]]["counts"]
    assert counts["reasoning_tokens"] == want_reasoning > 0
    assert summary["reasoning_share"] == pytest.approx(want_reasoning / counts["supervised_tokens"])
    assert counts["generated_by"] == {"the target, greedy": 1, "hand-written": 2}
    assert manifest_json(reader.dir)["config"]["tokenizer"]["thinking"] == "on"


def test_reasoning_with_thinking_off_is_one_line_from_the_cli(tmp_path, targets):
    data = write_rows(tmp_path / "rows.jsonl", [as_row("single_turn"), as_row("reasoning_last")])
    cache = tmp_path / "cache"
    result = cli("extract", "--target", str(targets[("qwen3.6", False)]), "--data", str(data), "--cache", str(cache),
                 "--num-shards", "1", "--no-thinking")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "rows.jsonl:2:" in lines[0] and "reasoning" in lines[0] and "thinking is off" in lines[0], lines[0]
    assert not (cache / "manifest.json").exists()


def test_verify_rederives_and_show_marks_kinds(tmp_path, targets):
    """verify-cache re-derives every mask with the same rule (row fields included), and --show
    colours reasoning, tool-call, content and end-of-turn tokens apart."""
    from pipeline.data.loss_mask import token_kinds
    from pipeline.verify.sample_view import show_sample
    from stages.verify_cache.options import VerifyOptions
    from stages.verify_cache.run import run_verify
    target = targets[("qwen3.6", True)]
    shapes = ["tool_with_reasoning", "reasoning_last", "assistant_first", "content_null"]
    extract_cases(tmp_path, target, "qwen3.6", "thinking", shapes)
    result = run_verify(VerifyOptions(cache=tmp_path / "cache", target=target))
    checks = {c["check"]: c for c in result["checks"]}
    assert checks["loss_mask"]["status"] == "pass" and "4 samples" in checks["loss_mask"]["summary"], checks["loss_mask"]
    assert checks["mask_boundaries"]["status"] == "pass", checks["mask_boundaries"]
    from pipeline.ui import SPAN_STYLES
    shown = show_sample(tmp_path / "cache", 0, target)
    header = shown["summary"]
    styles = {SPAN_STYLES[k] for k in shown["kinds"]}
    assert len(styles) >= 5, styles  # unsupervised, reasoning, content, tool call, end of turn
    assert "reasoning" in header and "tool call" in header
    # The kinds of a hand-made turn, from the rule in the docstring of token_kinds.
    pieces = ["<|im_start|>", "assistant\n", "<think>\n", "Hm", "\n</think>", "\n\n", "Ok", "<tool_call>", "{}",
              "</tool_call>", "<|im_end|>", "\n"]
    mask = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0]
    ends = [sum(len(p) for p in pieces[:k + 1]) for k in range(len(pieces))]
    offsets = [(e - len(p), e) for p, e in zip(pieces, ends)]
    kinds = token_kinds("".join(pieces), offsets, mask, END)
    assert kinds == ["", "", "", "reasoning", "reasoning", "content", "content", "tool_call", "tool_call", "tool_call",
                     "end_of_turn", ""]
