"""`pipeline generate`: the target regenerates the responses, in this process or through a real
OpenAI-compatible server on 127.0.0.1; sharded, resumable after kill -9, one-line errors."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from harness.caches import manifest_json
from harness.ports import free_port
from harness.runs import REPO, cli, cli_here, torchrun, write_rows
from harness.prerequisites import importable, missing, needs

from pipeline.errors import PipelineError
from stages.generate.options import GenerateOptions
from stages.generate.run import run_generate

ROWS = 16


def decided_rows(target, tokenizer, rows: list[dict], n: int, gap: float = 1e-3) -> list[dict]:
    """The first n rows whose every supervised token the target prefers by more than `gap` (top-2
    logit gap, fp32, teacher-forced). Greedy decoding of a near-tie depends on float summation
    order, which differs with the number of rows decoding together (the kit decoded 64 at a time,
    these tests 8): 2 of the 200 held-out rows have such a tie, and either answer is the target's."""
    import torch

    from pipeline.data.loss_mask import tokenize_conversation

    picked = []
    for row in rows:
        sample = tokenize_conversation(tokenizer, row["messages"], "<|im_end|>", tools=row.get("tools"),
                                       **row.get("chat_template_kwargs", {}))
        with torch.no_grad():
            top = target(input_ids=torch.tensor([sample.input_ids])).logits[0, :-1].topk(2, dim=-1).values
        supervised = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
        if (top[:, 0] - top[:, 1])[supervised].min() > gap:
            picked.append(row)
        if len(picked) == n:
            return picked
    raise AssertionError(f"fewer than {n} rows without a near-tie")


@pytest.fixture(scope="module")
def rows(target, tokenizer, heldout_rows):
    return decided_rows(target, tokenizer, heldout_rows, ROWS)


@pytest.fixture(scope="module")
def data(tmp_path_factory, rows):
    """Held-out conversations: their assistant turns are the target's own greedy answers (the kit
    regenerated every turn in order), so regenerating them must give them back."""
    return write_rows(tmp_path_factory.mktemp("data") / "heldout.jsonl", rows)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    out = tmp_path_factory.mktemp("ref") / "out.jsonl"
    summary = run_generate(GenerateOptions(data=[str(data)], out=out, num_shards=3, max_new_tokens=96, batch_size=8))
    return out, summary


def messages(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]


def test_in_process_gives_back_the_targets_greedy_answers(reference, rows):
    out, summary = reference
    assert summary["assembled"] and summary["rows_written"] == ROWS and summary["dropped_unfinished"] == 0
    assert summary["turns_written"] == sum(m["role"] == "assistant" for r in rows for m in r["messages"])
    assert messages(out) == [r["messages"] for r in rows]
    first = json.loads(out.read_text().splitlines()[0])
    assert first["id"] == rows[0]["id"]
    assert first["generated_by"]["backend"] == "in-process" and first["generated_by"]["sampling"]["temperature"] == 0
    assert summary["tokens"] > 0 and summary["tokens_per_s"] > 0


def test_last_turn_only_and_the_manifest_records_the_source(tmp_path, data, rows):
    from pipeline.config import ExtractConfig
    from stages.extract.run import run_extract

    out = tmp_path / "last.jsonl"
    summary = run_generate(GenerateOptions(data=[str(data)], out=out, turns="last", max_new_tokens=96, batch_size=8))
    assert summary["turns_written"] == ROWS
    assert messages(out) == [r["messages"] for r in rows]
    run_extract(ExtractConfig(cache=str(tmp_path / "cache"), data=[str(out)], num_shards=1), None, progress=False)
    manifest = manifest_json(tmp_path / "cache")
    sources = [json.loads(s) for s in next(iter(manifest["shards"].values()))["counts"]["generated_by"]]
    assert [s["backend"] for s in sources] == ["in-process"] and sources[0]["sampling"]["turns"] == "last"


def test_two_processes_write_what_one_does(tmp_path, data, reference):
    out = tmp_path / "dp2.jsonl"
    result = torchrun(2, "generate", "--data", str(data), "--out", str(out), "--num-shards", "3",
                      "--max-new-tokens", "96", "--batch-size", "8", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.read_bytes() == reference[0].read_bytes()


def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, data, reference):
    out = tmp_path / "killed.jsonl"
    cmd = [sys.executable, "-m", "cli", "generate", "--data", str(data), "--out", str(out), "--num-shards", "3",
           "--max-new-tokens", "96", "--batch-size", "8", "--json"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parts = Path(str(out) + ".parts")
    deadline = time.time() + 120
    while time.time() < deadline and not (parts / "shard-00000.json").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (parts / "shard-00000.json").exists(), "the first shard was never committed"
    assert not out.exists(), "the kill landed after everything was done"
    result = cli(*cmd[3:])
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    assert summary["shards_already_done"] >= 1 and summary["shards_written"] >= 1
    assert out.read_bytes() == reference[0].read_bytes()


def test_sampling_is_seeded_per_sequence(tmp_path, data):
    """Temperature sampling: each turn draws from its own generator (seed, row, turn), so the batch
    it shares does not change it; another seed changes the text."""
    runs = {}
    for name, batch, seed in (("b1", 1, 5), ("b8", 8, 5), ("other", 8, 6)):
        out = tmp_path / f"{name}.jsonl"
        run_generate(GenerateOptions(data=[str(data)], out=out, turns="last", max_new_tokens=32, temperature=1.0,
                                     top_p=0.9, seed=seed, batch_size=batch))
        runs[name] = messages(out)
    assert runs["b1"] == runs["b8"]
    assert runs["other"] != runs["b8"]


def test_bad_input_and_mismatched_resume_are_one_line_errors(tmp_path, data, train_rows):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(train_rows[0]) + "\n{not json\n")
    result = cli_here("generate", "--data", str(bad), "--out", str(tmp_path / "o.jsonl"))
    assert result.returncode != 0 and f"{bad}:2: malformed JSON" in result.stderr
    assert not (tmp_path / "o.jsonl").exists()
    tokenized = write_rows(tmp_path / "ids.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    with pytest.raises(PipelineError, match=r"ids.jsonl:1: a pre-tokenized row"):
        run_generate(GenerateOptions(data=[str(tokenized)], out=tmp_path / "ids-out.jsonl"))
    out = tmp_path / "resume.jsonl"
    run_generate(GenerateOptions(data=[str(data)], out=out, shards="0", num_shards=3, max_new_tokens=96,
                                 batch_size=8))
    assert not out.exists()      # 2 of 3 shards missing: no output that looks complete
    with pytest.raises(PipelineError, match=r"made with another generated_by"):
        run_generate(GenerateOptions(data=[str(data)], out=out, num_shards=3, max_new_tokens=32, batch_size=8))
    for kwargs, message in (({"turns": "first"}, "--turns must be one of all, last"),
                            ({"top_p": 0.0}, r"--top-p must be in \(0, 1\]"),
                            ({"server": "127.0.0.1:1"}, "--server must be an http")):
        with pytest.raises(PipelineError, match=message):
            run_generate(GenerateOptions(data=[str(data)], out=tmp_path / "x.jsonl", **kwargs))


def test_resume_ignores_how_the_work_ran_and_names_what_differs(tmp_path, data, reference):
    """The resume plan compares what decides the output (data, shards, target, sampling), not the
    batch size; a refusal names the field and both values; once OUT.jsonl is written the shard
    files go (complete.json records the output) and a re-run does nothing."""
    out = tmp_path / "resume.jsonl"
    run_generate(GenerateOptions(data=[str(data)], out=out, shards="0", num_shards=3, max_new_tokens=96,
                                 batch_size=8))
    with pytest.raises(PipelineError) as refused:
        run_generate(GenerateOptions(data=[str(data)], out=out, num_shards=3, max_new_tokens=32, batch_size=8))
    assert "made with another generated_by.sampling.max_new_tokens (96 then, 32 now)" in str(refused.value)
    summary = run_generate(GenerateOptions(data=[str(data)], out=out, num_shards=3, max_new_tokens=96, batch_size=3))
    assert summary["shards_already_done"] == 1 and summary["shards_written"] == 2 and summary["assembled"]
    assert out.read_bytes() == reference[0].read_bytes()
    parts = Path(str(out) + ".parts")
    assert sorted(p.name for p in parts.iterdir()) == ["complete.json", "plan.json"], list(parts.iterdir())
    assert "keeps plan.json and complete.json only" in summary["parts"]
    again = run_generate(GenerateOptions(data=[str(data)], out=out, num_shards=3, max_new_tokens=96, batch_size=16))
    assert again["shards_written"] == 0 and again["assembled"] and again["rows"] == 0
    assert out.read_bytes() == reference[0].read_bytes()


def test_a_row_cut_short_is_reported_where_it_breaks(tmp_path, train_rows):
    row = json.dumps(train_rows[0])
    bad = tmp_path / "cut.jsonl"
    bad.write_text(row + "\n" + row[:-2] + "\n")       # the second row lost its closing ]}
    result = cli("generate", "--data", str(bad), "--out", str(tmp_path / "o.jsonl"))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    want = (f"{bad}:2: malformed JSON (Expecting ',' delimiter at column {len(row) - 1} of {len(row) - 2}, past the "
            f"end of the line: the row looks cut short); the line starts {row[:40] + '...'!r}")
    assert want in lines[0], lines[0]


# ----------------------------------------------------------------- a real server: transformers serve

def _serve(port: int, target: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "transformers"), "serve", str(target),
                             "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("transformers serve exited before answering")
            time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("transformers serve did not answer within 120 s")


@pytest.fixture(scope="module")
def serving(embedded):
    importable("fastapi", "transformers serve needs its serving extras: pip install -e '.[test]'")
    importable("uvicorn", "transformers serve needs its serving extras: pip install -e '.[test]'")
    if not (Path(sys.executable).parent / "transformers").is_file():
        missing("the `transformers` command is not beside this Python")
    return embedded.TARGET_DIR


def test_a_real_server_gives_what_the_target_gives_in_process(tmp_path, serving, data, reference):
    port = free_port()
    server = _serve(port, serving)
    try:
        out = tmp_path / "served.jsonl"
        summary = run_generate(GenerateOptions(data=[str(data)], out=out, server=f"http://127.0.0.1:{port}",
                                               target=str(serving), num_shards=3, max_new_tokens=96,
                                               concurrency=4))
        assert summary["assembled"] and summary["rows_written"] == ROWS
        assert messages(out) == messages(reference[0])
        assert json.loads(out.read_text().splitlines()[0])["generated_by"]["backend"] == "server"
        with pytest.raises(PipelineError, match="does not serve 'gpt-4'"):
            run_generate(GenerateOptions(data=[str(data)], out=tmp_path / "wrong.jsonl",
                                         server=f"http://127.0.0.1:{port}", model="gpt-4"))
        # A target whose chat template differs from what the server renders: refused at the first answer.
        other = tmp_path / "other-target"
        shutil.copytree(serving, other)
        template = other / "chat_template.jinja"
        template.write_text("{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}" + template.read_text())
        with pytest.raises(PipelineError, match=r"the server counts \d+ prompt tokens where the target's tokenizer and "
                                                r"chat template give \d+"):
            run_generate(GenerateOptions(data=[str(data)], out=tmp_path / "mismatch.jsonl",
                                         server=f"http://127.0.0.1:{port}", target=str(other),
                                         max_new_tokens=8))
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_a_server_killed_mid_run_is_a_clear_error_and_the_output_resumes(tmp_path, serving, data, reference, monkeypatch):
    import pipeline.generate.server as server_module
    from pipeline.generate.parts import Parts

    monkeypatch.setattr(server_module, "BACKOFF_S", 0.05)   # the retries still happen, only sooner
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _serve(port, serving)
    out = tmp_path / "interrupted.jsonl"
    original_write = Parts.write

    def write_then_kill(self, shard, rows, record):
        written = original_write(self, shard, rows, record)
        if shard == 0:
            os.killpg(server.pid, signal.SIGKILL)   # the server dies once the first shard is on disk
            server.wait()
        return written

    monkeypatch.setattr(Parts, "write", write_then_kill)
    with pytest.raises(PipelineError, match=r"heldout.jsonl:\d+ \(assistant turn 1\): no answer from .* after 5 tries"):
        run_generate(GenerateOptions(data=[str(data)], out=out, server=url, num_shards=3, max_new_tokens=96))
    monkeypatch.setattr(Parts, "write", original_write)
    assert not out.exists() and Parts(out).done(0) is not None and Parts(out).done(1) is None
    port = free_port()        # restarted on another port, reached by another name: the same output
    server = _serve(port, serving)
    try:
        summary = run_generate(GenerateOptions(data=[str(data)], out=out, server=f"http://localhost:{port}",
                                               num_shards=3, max_new_tokens=96))
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert summary["shards_already_done"] == 1 and summary["shards_written"] == 2
    assert messages(out) == messages(reference[0])


# ----------------------------------------------------------------- the split of a generated turn

TEMPLATES = REPO.parent / "shared" / "fixtures" / "chat_templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


TURNS_TO_SPLIT = {
    "content": {"content": "2 plus 3 is 5."},
    "reasoning": {"reasoning_content": "Two plus three.\nThat is five.", "content": "5."},
    "tool_call": {"reasoning_content": "I need the weather.", "content": "", "tool_calls": [_call("get_weather", city="Paris")]},
    "content_and_calls": {"content": "Let me check both.", "tool_calls": [
        _call("get_weather", city="Paris"), _call("get_weather", city="Lyon\nFrance", days=3, hourly=True, tags=["a", "b"])]},
}


@needs(TEMPLATES.is_dir(), f"real chat templates not found at {TEMPLATES} (the project's shared fixtures folder)")
@pytest.mark.parametrize("template, kwargs, supplied", [
    ("qwen3", {}, ""), ("qwen3.5", {}, "<think>\n"), ("qwen3.6", {}, "<think>\n"),
    ("qwen3.6", {"enable_thinking": False}, "<think>\n\n</think>\n\n")])
@pytest.mark.parametrize("shape", sorted(TURNS_TO_SPLIT))
def test_a_generated_turn_splits_as_the_template_renders_it(tokenizer, template, kwargs, supplied, shape):
    """Oracle: the real template. Render a conversation whose last turn has these fields, take the
    text after the generation prompt (what the target would have written), split it, and the split
    must be the fields again and render to the same text."""
    import copy

    from pipeline.generate.assistant import parse_assistant

    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    turn = {"role": "assistant", **TURNS_TO_SPLIT[shape]}
    if kwargs.get("enable_thinking") is False:
        turn.pop("reasoning_content", None)
    before = [{"role": "user", "content": "Weather in Paris?"}]

    def render(messages, prompt):
        return tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=prompt, **kwargs)

    prompt, full = render(before, True), render(before + [turn], False)
    assert prompt.endswith(supplied) and full.startswith(prompt) and full.endswith("<|im_end|>\n")
    generated = full[len(prompt):-len("<|im_end|>\n")]
    parsed = parse_assistant(generated, supplied)
    assert parsed.problem is None
    assert render(before + [parsed.message], False) == full
    assert parsed.message.get("tool_calls", []) == turn.get("tool_calls", [])
    assert parsed.message.get("reasoning_content", "") == turn.get("reasoning_content", "")
    assert (parsed.message["content"] or "") == turn["content"]
    if "</think>" in supplied:
        # The empty block the prompt closed itself is not reasoning the target wrote: no field.
        assert "reasoning_content" not in parsed.message


def test_text_the_fields_cannot_hold_stays_verbatim():
    from pipeline.generate.assistant import parse_assistant

    for text, problem in (("<tool_call>\n{not json\n</tool_call>", "a tool call that does not parse"),
                          ("<tool_call>\n<function=f>\n</function>\n</tool_call>\nand then more", "text after the tool calls"),
                          ("thinking forever", "reasoning never closed")):
        parsed = parse_assistant(text, "<think>\n" if problem == "reasoning never closed" else "")
        assert parsed.problem == problem and parsed.message["content"] == text and "tool_calls" not in parsed.message


def test_requests_carry_the_ids_openai_servers_require():
    """vLLM refuses a chat request whose tool calls have no `id` or whose tool replies have no
    `tool_call_id` (OpenAI's schema); datasets seldom keep them. The rule, checked here: every
    call gets an id (the data's own kept), the k-th reply after a turn answers its k-th call, the
    arguments go as JSON text that reads back as the data's, and the data is left untouched."""
    import copy

    from pipeline.generate.server import openai_messages

    conversation = [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", city="Paris"), _call("get_weather", city="Lyon")]},
        {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Lyon."},
        {"role": "user", "content": "And Nice?"},
        {"role": "assistant", "content": "", "tool_calls": [{**_call("get_weather", city="Nice"), "id": "mine"}]},
        {"role": "tool", "content": "windy", "tool_call_id": "mine"},
    ]
    before = copy.deepcopy(conversation)
    sent = openai_messages(conversation)
    assert conversation == before
    calls = {i: [c["id"] for c in m["tool_calls"]] for i, m in enumerate(sent) if m.get("tool_calls")}
    assert all(calls.values()) and len({i for ids in calls.values() for i in ids}) == 3
    assert calls[6] == ["mine"]
    assert [m["tool_call_id"] for m in sent if m["role"] == "tool"] == calls[1] + calls[6]
    for original, message in zip(conversation, sent):
        for a, b in zip(original.get("tool_calls", []), message.get("tool_calls", [])):
            assert json.loads(b["function"]["arguments"]) == a["function"]["arguments"] and b["type"] == "function"
    assert [m["content"] for m in sent] == [m["content"] for m in conversation]
