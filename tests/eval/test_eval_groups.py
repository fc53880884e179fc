"""eval's tau per kind of turn (thinking, non-thinking, tool call) and per row field (--group-by,
issue 41). The kind rule is checked against the real Qwen3.6 template's rendered text (a prompt
in thinking mode ends in an open `<think>`); the groups against the whole (a group's pooled tau
times its verify steps sums to the whole's) on a real eval of the embedded target."""

import json
from pathlib import Path

import pytest
from harness.runs import REPO, cli_here
from harness.prerequisites import missing

from pipeline.data.loss_mask import render
from pipeline.errors import PipelineError
from pipeline.eval.groups import MISSING, TurnMarkers, turn_kind
from stages.eval.options import EvalOptions
from stages.eval.run import run_eval

FIXTURES = REPO.parent / "shared" / "fixtures"


@pytest.fixture(scope="module")
def qwen36():
    from transformers import AutoTokenizer

    folder, template = FIXTURES / "tokenizers" / "qwen3.6", FIXTURES / "chat_templates" / "qwen3.6.jinja"
    if not folder.is_dir() or not template.is_file():
        missing(f"the real Qwen3.6 tokenizer/template fixtures are not at {FIXTURES}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template.read_text()
    return tokenizer


def test_kind_of_turn_follows_the_templates_think_block(qwen36):
    markers = TurnMarkers.of(qwen36)
    assert None not in (markers.im_start, markers.think, markers.think_end, markers.tool_call)
    history = [{"role": "user", "content": "Think first: what is 2 + 3?"},
               {"role": "assistant", "content": "5.", "reasoning_content": "2 + 3 = 5."},
               {"role": "user", "content": "And 4 + 4?"}]
    answer = qwen36("Eight.", add_special_tokens=False)["input_ids"]
    for thinking in (True, False):
        text = render(qwen36, history, generation_prompt=True, template_kwargs={"enable_thinking": thinking})
        # The oracle, from the template's text: thinking mode leaves `<think>\n` open at the end.
        assert text.endswith("<think>\n") == thinking, text[-60:]
        prompt = qwen36(text, add_special_tokens=False)["input_ids"]
        assert turn_kind(prompt, answer, markers) == ("thinking" if thinking else "non_thinking")
        call = answer + [markers.tool_call] + qwen36('{"name": "add"}', add_special_tokens=False)["input_ids"]
        assert turn_kind(prompt, call, markers) == "tool_call"
    closed = qwen36(render(qwen36, history, generation_prompt=True, template_kwargs={"enable_thinking": False}),
                    add_special_tokens=False)["input_ids"]
    assert turn_kind(closed, [markers.think] + answer, markers) == "thinking"  # the output opens one itself


@pytest.fixture(scope="module")
def grouped(trained_run, heldout_rows, tmp_path_factory):
    rows = [dict(row) for row in pick_kinds(heldout_rows)]
    for i, row in enumerate(rows[:6]):
        row["category"] = "even" if i % 2 == 0 else "odd"
    path = tmp_path_factory.mktemp("groups") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_eval(EvalOptions(drafter=trained_run["run"], target=None, prompts=path, max_new_tokens=32,
                                  block_size=None, tree_budget=[4], tree_top_k=4, limit=None,
                                  group_by="category"))
    return path, result


def expected_kind(row: dict) -> str:
    """The oracle, from the row itself: the held-out rows' last turn is the target's own greedy
    answer, so it calls a tool exactly when the row's last message does; otherwise the row's
    thinking mode decides."""
    if row["messages"][-1].get("tool_calls"):
        return "tool_call"
    return "thinking" if row["chat_template_kwargs"]["enable_thinking"] else "non_thinking"


def pick_kinds(rows: list[dict]) -> list[dict]:
    """Seven held-out rows: three thinking, two non-thinking, two ending at a tool call."""
    wanted = {"thinking": 3, "non_thinking": 2, "tool_call": 2}
    picked = []
    for row in rows:
        kind = expected_kind(row)
        if wanted[kind]:
            wanted[kind] -= 1
            picked.append(row)
    assert not any(wanted.values()), wanted
    return picked


def _sums_to_the_whole(groups: dict, whole: dict) -> None:
    assert sum(g["verify_steps"] for g in groups) == whole["verify_steps"] > 0
    assert sum(g["tau_pooled"] * g["verify_steps"] for g in groups) == pytest.approx(whole["tau_pooled"] * whole["verify_steps"])


def test_groups_by_a_field_sum_to_the_whole(grouped):
    _, result = grouped
    groups = result["by_field"]["groups"]
    assert result["by_field"]["field"] == "category" and result["lossless"]
    assert {k: g["prompts"] for k, g in groups.items()} == {"even": 3, "odd": 3, MISSING: 1}
    _sums_to_the_whole([g["block"] for g in groups.values()], result["block"])
    _sums_to_the_whole([g["tree"]["4"] for g in groups.values()], result["tree"]["4"])


def test_kinds_cover_every_prompt(grouped):
    _, result = grouped
    kinds = result["by_kind"]
    assert {k: g["prompts"] for k, g in kinds.items()} == {"thinking": 3, "non_thinking": 2, "tool_call": 2}
    _sums_to_the_whole([g["block"] for g in kinds.values()], result["block"])


def test_the_report_shows_decoded_tau_by_kind(grouped, trained_run, tmp_path):
    """`pipeline report RUN --eval EVAL_JSON`: eval's pooled tau, overall and per kind, beside the
    training verdicts, and a plot; a file that is not an eval result is a one-line error."""
    _, result = grouped
    eval_json = tmp_path / "eval.json"
    eval_json.write_text(json.dumps(result))
    done = cli_here("report", str(trained_run["run"]), "--eval", str(eval_json), "--out", str(tmp_path / "plots"), "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)["eval"]
    assert shown["block"] == result["block"]["tau_pooled"] and shown["tree"]["4"] == result["tree"]["4"]["tau_pooled"]
    assert {k: (g["prompts"], g["block"]) for k, g in shown["by_kind"].items()} == \
        {k: (g["prompts"], g["block"]["tau_pooled"]) for k, g in result["by_kind"].items()}
    assert (tmp_path / "plots" / "report-tau-by-kind.png").stat().st_size > 0
    table = cli_here("report", str(trained_run["run"]), "--eval", str(eval_json), "--out", str(tmp_path / "plots"))
    assert "decoded tau" in table.stdout and "tool-call" in table.stdout
    eval_json.write_text(json.dumps({"prompts": 3}))
    bad = cli_here("report", str(trained_run["run"]), "--eval", str(eval_json), "--out", str(tmp_path / "plots"))
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
    assert f"--eval {eval_json}: not a `pipeline eval --json` result" in bad.stderr


def test_a_field_no_row_has_is_one_line(grouped, trained_run):
    path, _ = grouped
    with pytest.raises(PipelineError, match="--group-by source: no prompt row has this field .*category"):
        run_eval(EvalOptions(drafter=trained_run["run"], target=None, prompts=path, max_new_tokens=4, block_size=None,
                             tree_budget=[], tree_top_k=4, limit=None, group_by="source"))


def test_the_cli_prints_the_groups(grouped, trained_run):
    path, _ = grouped
    done = cli_here("eval", "--drafter", str(trained_run["run"]), "--prompts", str(path), "--max-new-tokens", "8",
               "--tree-budget", "", "--group-by", "category")
    assert done.returncode == 0, done.stderr
    assert "tau by kind of turn" in done.stdout and "tau by category" in done.stdout and "odd" in done.stdout


def test_the_rows_own_fields_reach_the_prompt(grouped, tokenizer):
    from pipeline.data.prompts import read_prompts

    path, _ = grouped
    items = read_prompts(Path(path), tokenizer, None)
    assert [i["fields"].get("category") for i in items] == ["even", "odd"] * 3 + [None]
