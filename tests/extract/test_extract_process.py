"""Stage one as users run it: the real CLI in subprocesses, torchrun (gloo), kill -9, bad input."""

import json
import signal
import subprocess
import sys
import time

import pytest

from harness.caches import assert_same_content, manifest_json
from harness.runs import REPO, cli, cli_here, torchrun, write_rows


@pytest.fixture(scope="module")
def data(tmp_path_factory, train_rows):
    return write_rows(tmp_path_factory.mktemp("data") / "convs.jsonl", train_rows[:24])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """One uninterrupted single-process run: 4 shards, small batches."""
    cache = tmp_path_factory.mktemp("ref") / "cache"
    result = cli_here("extract", "--cache", str(cache), "--data", str(data), "--num-shards", "4", "--batch-tokens", "256", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["shards_written"] == 4 and summary["samples"] == 24
    return cache


def manifest(cache):
    return manifest_json(cache)


def row_ranges(cache):
    return {name: rec["row_range"] for name, rec in manifest(cache)["shards"].items()}


def test_data_parallel_2_matches_one_process(tmp_path, data, reference):
    cache = tmp_path / "dp2"
    result = torchrun(2, "extract", "--cache", str(cache), "--data", str(data), "--num-shards", "4",
                      "--batch-tokens", "256", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_content(cache, reference)
    assert row_ranges(cache) == row_ranges(reference)
    assert {rec["layout"]["dp"] for rec in manifest(cache)["shards"].values()} == {2}


def test_shard_plan_is_independent_of_process_count(tmp_path, data, reference):
    cache = tmp_path / "dp4"
    result = torchrun(4, "extract", "--cache", str(cache), "--data", str(data), "--num-shards", "4",
                      "--batch-tokens", "256", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert row_ranges(cache) == row_ranges(reference)
    assert_same_content(cache, reference)


def test_kill_mid_shard_then_resume(tmp_path, data, reference):
    cache = tmp_path / "killed"
    cmd = [sys.executable, "-m", "cli", "extract", "--cache", str(cache), "--data", str(data), "--num-shards", "4",
           "--batch-tokens", "256", "--json"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    # Wait until a shard is half-written, and at least one other has been committed, then kill -9.
    while time.time() < deadline:
        committed = list(cache.glob("shard-*/digests.json"))
        partial = [d for d in cache.glob("shard-*") if not (d / "digests.json").exists()]
        if partial and committed:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial, "never saw a partial shard"
    listed = manifest(cache)["shards"] if (cache / "manifest.json").exists() else {}
    assert all((cache / name).is_dir() for name in listed)
    assert len(listed) < 4, "the kill landed after everything was committed"
    result = cli_here("extract", "--cache", str(cache), "--data", str(data), "--num-shards", "4", "--batch-tokens", "256", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["shards_written"] == 4 - len(listed)
    assert all((d / "digests.json").exists() for d in cache.glob("shard-*"))
    assert_same_content(cache, reference)


@pytest.mark.parametrize("ranges", [("0-3", "0-3"), ("0-2", "1-3")], ids=["same", "overlapping"])
def test_two_processes_never_write_one_shard(tmp_path, data, reference, ranges):
    cache = tmp_path / "race"
    cmd = [sys.executable, "-m", "cli", "extract", "--cache", str(cache), "--data", str(data), "--num-shards", "4",
           "--batch-tokens", "256", "--json"]
    procs = [subprocess.Popen([*cmd, "--shards", r], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in ranges]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    written = sum(json.loads(o[0])["shards_written"] for o in outs)
    assert written == 4, "each shard written exactly once across both processes"
    assert_same_content(cache, reference)


BAD_ROWS = [
    ("malformed.jsonl", b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n{"messages": [\n', "malformed.jsonl:2: malformed JSON"),
    ("nomessages.jsonl", b'{"text": "hello"}\n', "nomessages.jsonl:1: row has none of 'messages'"),
    ("role.jsonl", b'{"messages": [{"role": "robot", "content": "x"}]}\n', "role.jsonl:1: messages[0].role is 'robot'"),
    ("image.jsonl", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]}, {"role": "assistant", "content": "ok"}]}\n',
     "image.jsonl:1: messages[0].content[1] is a 'image_url' part"),
    ("calls.jsonl", b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, "tool_calls": {"name": "f"}}]}\n',
     "calls.jsonl:1: messages[1].tool_calls must be a list"),
    ("orphan.jsonl", b'{"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]}\n',
     "orphan.jsonl:1: messages[1] is a tool reply with no tool call before it"),
    ("content.jsonl", b'{"messages": [{"role": "user", "content": 5}]}\n', "content.jsonl:1: messages[0].content must be a string"),
    ("binary.jsonl", b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n\xff\xfe\n', "binary.jsonl:2: not valid UTF-8"),
    ("noassistant.jsonl", b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}\n',
     "noassistant.jsonl:1: field 'messages' has no assistant turn"),
    ("empty.jsonl", b"\n\n", "the dataset has no rows"),
    ("pretok.jsonl", b'{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}\n', "pretok.jsonl:1: field 'loss_mask' must be"),
]


@pytest.mark.parametrize("name, content, message", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_bad_rows_are_one_clear_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    cache = tmp_path / "cache"
    run = cli if name == BAD_ROWS[0][0] else cli_here  # one in a real process: no stray library output
    result = run("extract", "--cache", str(cache), "--data", str(path), "--num-shards", "1")
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (cache / "manifest.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--shards", "0-9"], "--shards: '0-9' is outside 0-3"),
    (["--shards", "a-b"], "--shards: 'a-b' is not a shard index"),
    (["--layers", "1,7"], "7 is the last decoder layer"),
    (["--layers", "1,9"], "9 is out of range"),
    (["--target", "/nonexistent-target"], "not a target model directory"),
    (["--hidden-format", "fp4"], "hidden_format must be 'bf16' or 'fp8'"),
])
def test_bad_options_are_one_clear_line(tmp_path, data, args, message):
    cache = tmp_path / "cache"
    run = cli if args[0] == "--target" else cli_here  # one in a real process
    result = run("extract", "--cache", str(cache), "--data", str(data), "--num-shards", "4", *args)
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (cache / "manifest.json").exists()


@pytest.mark.parametrize("remove, message", [
    (["model.safetensors"], "no weight files"),
    (["tokenizer.json", "tokenizer_config.json"], "no tokenizer files"),
])
def test_target_without_weights_or_tokenizer(tmp_path, data, embedded, remove, message):
    import shutil
    target = tmp_path / "target"
    shutil.copytree(embedded.TARGET_DIR, target)
    for name in remove:
        (target / name).unlink()
    result = cli_here("extract", "--cache", str(tmp_path / "cache"), "--data", str(data), "--target", str(target))
    assert result.returncode == 1 and message in result.stderr and str(target) in result.stderr, result.stderr
    assert not (tmp_path / "cache" / "manifest.json").exists()


def test_an_over_long_sample_is_an_error_when_asked(tmp_path, data):
    cache = tmp_path / "cache"
    result = cli_here("extract", "--cache", str(cache), "--data", str(data), "--num-shards", "4", "--max-length", "20",
                      "--overlong", "error")
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"{data}:1: " in lines[0] and "over max_length 20" in lines[0], result.stderr
    assert manifest(cache)["shards"] == {} and not list(cache.glob("shard-*"))


def test_skip_policies_are_counted(tmp_path, train_rows):
    rows = [json.dumps(r) for r in train_rows[:6]]
    rows.insert(2, "{not json")
    rows.append(json.dumps({"messages": [{"role": "user", "content": "no answer here"}]}))
    rows.append(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}))
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(rows) + "\n")
    cache = tmp_path / "cache"
    result = cli_here("extract", "--cache", str(cache), "--data", str(path), "--num-shards", "1", "--on-error", "skip",
                      "--max-length", "100", "--overlong", "skip", "--json")
    assert result.returncode == 0, result.stderr
    counts = manifest(cache)["shards"]["shard-00000"]["counts"]
    assert counts["rows"] == 9 and counts["malformed"] == 2 and counts["no_supervised_tokens"] == 1
    assert counts["overlong_skipped"] >= 1
    summary = json.loads(result.stdout)
    assert summary["samples"] == 9 - 2 - 1 - counts["overlong_skipped"]


def test_tensor_parallel_2_matches_one_process(tmp_path, data, reference):
    """TP 2 on a target with Qwen3.6-27B's head ratio scaled down (6 q : 1 kv): the KV heads do
    not divide by the TP size, so attention is replicated and everything else sharded."""
    cache = tmp_path / "tp2"
    result = torchrun(2, "extract", "--cache", str(cache), "--data", str(data), "--num-shards", "4",
                      "--batch-tokens", "256", "--tp", "2", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    records = manifest(cache)["shards"].values()
    assert {r["layout"]["tp"] for r in records} == {2}
    assert all("self_attn replicated" in r["layout"]["tp_plan"] for r in records)
    assert row_ranges(cache) == row_ranges(reference)
    # Sharded matmuls sum in another order: equal within float32 noise, then the bf16 rounding.
    assert_same_content(cache, reference, exact=False, atol=0.02)
