"""`pipeline eval --outputs FILE`: a JSON line per prompt with what the reference and every variant
decoded, streamed per batch of prompts to FILE.partial and renamed to FILE at the end."""

import json

import pytest
import torch
from harness.runs import cli_here

from pipeline.data.prompts import read_prompts
from pipeline.eval.speculative_decoding import greedy
from pipeline.eval.groups import KINDS
from pipeline.eval.speculative_sampling import SpeculativeSampler
from pipeline.target_model import end_of_turn_ids
from pipeline.target_model.live import LiveTarget
from stages.eval.options import EvalOptions
from stages.eval.run import run_eval

PROMPTS, MAX_NEW = 4, 24


def lines_of(path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n") or not text, "a line cut short"
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def live(target):
    return LiveTarget(target, [1, 3, 5])


@pytest.fixture(scope="module")
def prompts(tokenizer, embedded):
    return [p["ids"] for p in read_prompts(embedded.HELDOUT_DATA, tokenizer, PROMPTS)]


@pytest.fixture(scope="module")
def greedy_eval(trained_run, tmp_path_factory):
    """A greedy eval of PROMPTS prompts, two per batch, block and DDTree 4, with --outputs; at each
    progress call the lines in FILE.partial so far (and whether FILE exists yet)."""
    path = tmp_path_factory.mktemp("outputs") / "o.jsonl"
    seen = []

    def progress(n, **_):
        partial = path.with_name(path.name + ".partial")
        seen.append((len(lines_of(partial)), path.exists()))

    result = run_eval(EvalOptions(drafter=trained_run["run"], target=None, prompts=None, max_new_tokens=MAX_NEW,
                                  block_size=None, tree_budget=[4], tree_top_k=4, limit=PROMPTS,
                                  batch_size=2, outputs=path), progress=progress)
    return {"result": result, "path": path, "lines": lines_of(path), "seen": seen}


def check_accepted(ids: list[int], accepted: list[int]) -> None:
    """The prefill gives the first token; each verify step adds its accepted draft tokens and the
    target's next token (accepted + 1), the last step cut at an end of turn or max_new."""
    emitted = 1 + sum(a + 1 for a in accepted)
    assert (emitted - accepted[-1] - 1 if accepted else 0) < len(ids) <= emitted, (len(ids), accepted)


def test_a_line_per_prompt_with_every_variant_streamed_per_batch(greedy_eval):
    lines, result = greedy_eval["lines"], greedy_eval["result"]
    assert [line["prompt"] for line in lines] == list(range(PROMPTS))
    for line in lines:
        assert set(line) == {"prompt", "kind", "greedy", "block", "tree"} and set(line["tree"]) == {"4"}, line.keys()
        assert line["kind"] in KINDS
    kinds = [line["kind"] for line in lines]
    assert {k: kinds.count(k) for k in set(kinds)} == {k: g["prompts"] for k, g in result["by_kind"].items()}
    assert result["outputs"] == str(greedy_eval["path"])
    assert not greedy_eval["path"].with_name("o.jsonl.partial").exists()
    # Two prompts a batch: their lines are in FILE.partial before the next batch decodes, FILE not yet.
    assert greedy_eval["seen"] == [(2, False), (4, False)]


@pytest.fixture(scope="module")
def forward_greedy(target, prompts, tokenizer):
    """Each prompt's greedy continuation written out as the definition: a full forward of the
    target over the prompt and every token so far (no KV cache, no LiveTarget), the argmax of the
    last position's logits, until `<|im_end|>` (the embedded tokenizer's eos too) or MAX_NEW
    tokens. The reference for eval's outputs, independent of the decoding code under test."""
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    decoded = []
    with torch.no_grad():
        for prompt in prompts:
            ids, new = list(prompt), []
            while len(new) < MAX_NEW and (not new or new[-1] not in stop):
                new.append(int(target(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
                ids.append(new[-1])
            decoded.append(new)
    return decoded


def test_the_ids_are_plain_greedys_and_the_text_their_decode(greedy_eval, forward_greedy, tokenizer):
    """Eval's greedy reference, its block and its DDTree outputs are, token for token and over
    their whole length, the target's greedy continuation computed by full forwards (DESIGN 4:
    speculative decoding is lossless)."""
    assert sum(map(len, forward_greedy)) > 3 * PROMPTS   # whole answers, not a few tokens each
    for line, reference in zip(greedy_eval["lines"], forward_greedy, strict=True):
        for out in (line["greedy"], line["block"], line["tree"]["4"]):
            assert out["ids"] == reference
            assert out["text"] == tokenizer.decode(out["ids"])
        for out in (line["block"], line["tree"]["4"]):
            assert out["departure"] is None
            check_accepted(out["ids"], out["accepted"])
    steps = [a + 1 for line in greedy_eval["lines"] for a in line["block"]["accepted"]]
    assert sum(steps) / len(steps) == pytest.approx(greedy_eval["result"]["block"]["tau_pooled"])


def test_a_sampled_eval_writes_its_samples(trained_run, live, prompts, tokenizer, tmp_path):
    path = tmp_path / "sampled.jsonl"
    result = run_eval(EvalOptions(drafter=trained_run["run"], target=None, prompts=None, max_new_tokens=16,
                                  block_size=None, tree_budget=[4], tree_top_k=4, limit=2,
                                  temperature=1.0, seed=5, outputs=path))
    lines = lines_of(path)
    assert result["lossless"] is None and len(lines) == 2
    eos = end_of_turn_ids(tokenizer)
    for i, (line, prompt) in enumerate(zip(lines, prompts)):
        assert set(line) == {"prompt", "kind", "plain_sampling", "block", "tree"}
        drawn = greedy(live, prompt, max_new=16, eos=eos, sampling=SpeculativeSampler(temperature=1.0, seed=5), row=i)
        assert line["plain_sampling"]["ids"] == drawn.tokens
        for out in (line["plain_sampling"], line["block"], line["tree"]["4"]):
            assert out["ids"] and out["text"] == tokenizer.decode(out["ids"])
        for out in (line["block"], line["tree"]["4"]):
            assert "departure" not in out   # sampled outputs are not compared with plain sampling's
            check_accepted(out["ids"], out["accepted"])


def test_a_failed_eval_leaves_whole_lines_in_the_partial_file_and_the_earlier_file(trained_run, tmp_path):
    path = tmp_path / "o.jsonl"
    path.write_text("an earlier eval's\n")

    def stop(n, **_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_eval(EvalOptions(drafter=trained_run["run"], target=None, prompts=None, max_new_tokens=8, block_size=None,
                             tree_budget=[], tree_top_k=4, limit=2, outputs=path), progress=stop)
    assert [line["prompt"] for line in lines_of(tmp_path / "o.jsonl.partial")] == [0]
    assert path.read_text() == "an earlier eval's\n"


def test_the_cli_writes_the_file_and_refuses_a_path_it_cannot_write(trained_run, tmp_path):
    run = str(trained_run["run"])
    path = tmp_path / "o.jsonl"
    ok = cli_here("eval", "--drafter", run, "--limit", "1", "--max-new-tokens", "8", "--tree-budget", "",
                  "--outputs", str(path))
    assert ok.returncode == 0, ok.stderr
    assert f"outputs: {path}" in ok.stdout and len(lines_of(path)) == 1
    # Refused in one line before anything is loaded: the drafter here is not even one.
    for bad, message in ((tmp_path / "nowhere" / "o.jsonl", f"the folder {tmp_path / 'nowhere'} does not exist"),
                         (tmp_path, "is a directory")):
        refused = cli_here("eval", "--drafter", str(tmp_path), "--outputs", str(bad))
        assert refused.returncode == 1 and message in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
