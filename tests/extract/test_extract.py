"""Stage one against the real tiny target and real Zarr stores on disk."""

import json

import numpy as np
import pytest
import torch

from pipeline.cache.reader import CacheReader
from pipeline.config import ExtractConfig
from pipeline.data.loss_mask import tokenize_conversation
from pipeline.errors import PipelineError
from stages.extract.run import run_extract
from harness.caches import assert_same_content, decoded, manifest_json
from harness.runs import cli_here, write_rows

TAPS = [1, 3, 5]


def pick_rows(rows, n):
    """n rows that include system prompts and multi-turn conversations (the first four), tool
    calls and replies, and both thinking modes."""
    multi = [r for r in rows if sum(m["role"] == "user" for m in r["messages"]) > 1 and r["messages"][0]["role"] == "system"]
    rest = [r for r in rows if r not in multi]
    picked = multi[:4] + rest[:n - 4]
    assert any(m["role"] == "tool" for r in picked for m in r["messages"])
    assert {r["chat_template_kwargs"]["enable_thinking"] for r in picked} == {False, True}
    return picked


def reference_tokens(tokenizer, row):
    """The row tokenized and masked directly, with its own tools and thinking mode."""
    return tokenize_conversation(tokenizer, row["messages"], "<|im_end|>", tools=row.get("tools"),
                                 **row.get("chat_template_kwargs", {}))


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, train_rows):
    path = tmp_path_factory.mktemp("data") / "convs.jsonl"
    return write_rows(path, pick_rows(train_rows, 24)), pick_rows(train_rows, 24)


def extract(cache, data, shards=None, **kw):
    cfg = ExtractConfig(cache=str(cache), data=[str(data)], num_shards=kw.pop("num_shards", 3), **kw)
    return run_extract(cfg, shards, progress=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, small_data):
    path = tmp_path_factory.mktemp("cache") / "c"
    summary = extract(path, small_data[0])
    return path, summary


def test_cache_equals_an_independent_forward(cache, small_data, target, tokenizer):
    path, summary = cache
    reader = CacheReader(path)
    rows = small_data[1]
    assert summary["samples"] == len(rows) and summary["shards_written"] == 3
    for sid in [0, 1, 2, 3, 10, 23]:  # 0-3 are multi-turn with a system prompt
        sample = reader.find(sid).sample(sid)
        ref = reference_tokens(tokenizer, rows[sid])
        assert sample["input_ids"].tolist() == ref.input_ids
        assert sample["loss_mask"].tolist() == ref.loss_mask
        with torch.no_grad():
            out = target(input_ids=torch.tensor([ref.input_ids]), output_hidden_states=True)
        want = torch.stack([out.hidden_states[t + 1][0] for t in TAPS], dim=1)
        torch.testing.assert_close(sample["hidden"].float(), want, atol=0.02, rtol=1 / 128)
        # Not off by one: the neighbouring layers are measurably further away.
        for shift in (0, 2):
            other = torch.stack([out.hidden_states[t + shift][0] for t in TAPS], dim=1)
            assert (sample["hidden"].float() - other).abs().max() > 0.1
        logits = out.logits[0]
        assert (torch.from_numpy(sample["target_argmax"]) == logits.argmax(-1)).float().mean() == 1.0
        top = torch.topk(logits, 32)
        assert np.array_equal(sample["target_topk_ids"], top.indices.numpy())
        np.testing.assert_allclose(sample["target_topk_logits"], top.values.numpy(), atol=1e-4)
        np.testing.assert_allclose(sample["target_logsumexp"], torch.logsumexp(logits, -1).numpy(), atol=1e-4)


def test_labels_follow_the_targets_own_predictions(cache):
    """On target-generated data, target_argmax[t-1] == input_ids[t] on supervised positions,
    and the rate collapses at shifts of one either way."""
    data = decoded(cache[0])
    rates = {}
    for shift in (-1, 0, 1):
        hits = total = 0
        for s in data.values():
            ids, arg, mask = s["input_ids"], s["target_argmax"], s["loss_mask"]
            for t in range(2, len(ids) - 2):
                if mask[t]:
                    hits += arg[t - 1 + shift] == ids[t]
                    total += 1
        rates[shift] = hits / total
    assert rates[0] > 0.98, rates
    assert rates[-1] < 0.5 and rates[1] < 0.5, rates


def test_loss_mask_boundaries_in_the_cache(cache, small_data, tokenizer):
    """Each supervised span starts right after the assistant header plus whatever the template
    supplies there (DESIGN 5), and ends on the <|im_end|> that closes the turn."""
    data = decoded(cache[0])
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = "<|im_start|>assistant\n"
    for sid in range(4):  # system + multi-turn rows
        thinking = small_data[1][sid]["chat_template_kwargs"]["enable_thinking"]
        ids, mask = data[sid]["input_ids"].tolist(), data[sid]["loss_mask"].tolist()
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        ends = [i for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
        assert len(starts) >= 2
        supplied = []
        for a, b in zip(starts, ends):
            h = max(i for i in range(a) if ids[i] == im_start)
            before = tokenizer.decode(ids[h:a])
            # Qwen3.6 renders earlier turns without a think block; the turns after the last user
            # message follow the generation prompt, which supplies "<think>\n" with thinking on
            # and an empty block with thinking off.
            assert before in {header, header + "<think>\n", header + "<think>\n\n</think>\n\n"}, before
            assert not any(mask[h:a])
            supplied.append(before[len(header):])
            assert ids[b] == im_end
        assert supplied[-1] == ("<think>\n" if thinking else "<think>\n\n</think>\n\n")
        # System and user turns are never supervised.
        assert mask[: ids.index(im_start, 1)] == [0] * ids.index(im_start, 1)


def test_offsets_and_sample_ids(cache, small_data):
    reader = CacheReader(cache[0])
    assert reader.sample_ids() == list(range(len(small_data[1])))
    for name in reader.shards:
        shard = reader.shard(name)
        rec = manifest_json(cache[0])["shards"][name]
        assert shard.offsets[0] == 0 and np.all(np.diff(shard.offsets) > 0)
        assert rec["tokens"] == shard.num_tokens and rec["samples"] == shard.num_samples
        assert rec["digest"].startswith("sha256:")
        assert rec["kernels"]["path"] == "torch"
        assert rec["kernels"]["ops"]["chunk_gated_delta_rule"]["calls"] > 0


def test_manifest_records_provenance(cache):
    m = manifest_json(cache[0])
    cap = m["config"]["capture"]
    assert cap["target_layer_ids"] == TAPS and "hidden_states[i + 1]" in cap["tap_convention"]
    assert cap["compute_dtype"] == "float32" and cap["hidden_format"] == "bf16"
    assert m["config"]["tokenizer"]["chat_template_sha256"] and m["config"]["target"]["weights"]["files"]
    assert m["provenance"]["torch"] and m["provenance"]["transformers"]
    assert "flash_linear_attention" in m["provenance"]


def test_rerun_is_a_no_op(cache, small_data):
    path, _ = cache
    before = (path / "manifest.json").read_bytes()
    digests = {n: r["digest"] for n, r in manifest_json(path)["shards"].items()}
    assert len(digests) == 3
    summary = extract(path, small_data[0])
    assert summary["shards_written"] == 0 and summary["shards_already_committed"] == 3
    assert {n: r["digest"] for n, r in manifest_json(path)["shards"].items()} == digests
    assert (path / "manifest.json").read_bytes() == before, "written once, when the cache was created"


def test_conflicting_configuration_is_refused(cache, small_data):
    with pytest.raises(PipelineError, match=r"different configuration \(capture.top_k: 32 -> 8"):
        extract(cache[0], small_data[0], top_k=8)
    result = cli_here("extract", "--cache", str(cache[0]), "--data", str(small_data[0]), "--num-shards", "3", "--layers", "1,2,5")
    assert result.returncode == 1
    assert "target_layer_ids" in result.stderr and "Traceback" not in result.stderr


def test_shard_selection_splits_work(tmp_path, small_data, cache):
    path = tmp_path / "split"
    first = extract(path, small_data[0], shards="0,2")
    assert first["shards_written"] == 2
    second = extract(path, small_data[0], shards="0-2")
    assert second["shards_written"] == 1 and second["shards_already_committed"] == 2
    assert_same_content(path, cache[0])


def test_background_writer_gives_the_same_cache(tmp_path, small_data, cache):
    summary = extract(tmp_path / "bg", small_data[0], writer_queue=2, batch_tokens=128)
    assert summary["writer"] == "background thread, queue 2"
    assert_same_content(tmp_path / "bg", cache[0], exact=False, atol=0.02)


def test_fp8_mode(tmp_path, small_data, cache):
    path = tmp_path / "fp8"
    summary = extract(path, small_data[0], hidden_format="fp8")
    assert summary["bytes_per_token"] < cache[1]["bytes_per_token"]
    a, b = decoded(path), decoded(cache[0])
    for sid in a:
        np.testing.assert_array_equal(a[sid]["target_argmax"], b[sid]["target_argmax"])
        ref = b[sid]["hidden"]
        err = np.abs(a[sid]["hidden"] - ref).max(axis=-1) / np.abs(ref).max(axis=-1)
        assert err.max() < 0.07, err.max()  # e4m3: 3 mantissa bits, scaled per token and tap


def sharegpt_turn(m: dict) -> dict:
    """LLaMA-Factory's ShareGPT: a call is a `function_call` turn, a reply an `observation`."""
    if m.get("tool_calls"):
        assert len(m["tool_calls"]) == 1 and not m.get("reasoning_content") and not m["content"]
        return {"from": "function_call", "value": json.dumps(m["tool_calls"][0]["function"])}
    turn = {"from": {"user": "human", "assistant": "gpt", "tool": "observation"}.get(m["role"], m["role"]),
            "value": m["content"]}
    if m.get("reasoning_content") is not None:
        turn["reasoning_content"] = m["reasoning_content"]
    return turn


def test_input_formats_give_the_same_cache(tmp_path, small_data, cache, tokenizer):
    rows = small_data[1]
    # ShareGPT has no place for reasoning before a call: such a row stays in the messages format
    # (the reader takes either format row by row), every other row is written as ShareGPT.
    sharegpt, converted = [], 0
    for r in rows:
        if any(m.get("tool_calls") and m.get("reasoning_content") for m in r["messages"]):
            sharegpt.append(r)
            continue
        converted += 1
        sharegpt.append({"conversations": [sharegpt_turn(m) for m in r["messages"]],
                         **{k: r[k] for k in ("tools", "chat_template_kwargs") if k in r}})
    assert converted >= len(rows) - 4 and any("function_call" in json.dumps(r) for r in sharegpt)
    pretok = []
    for r in rows:
        t = reference_tokens(tokenizer, r)
        pretok.append({"input_ids": t.input_ids, "loss_mask": t.loss_mask})
    import pyarrow as pa
    import pyarrow.parquet as pq
    parquet = tmp_path / "convs.parquet"
    # One Arrow schema for every row: tool schemas as a JSON string and call arguments as JSON
    # strings (the OpenAI wire format), as datasets on the hub store them.
    def arrow_row(r):
        messages = [{**m, "tool_calls": [{"type": "function", "function": {
            "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}} for c in m["tool_calls"]]}
            if m.get("tool_calls") else m for m in r["messages"]]
        return {"messages": messages, "tools": json.dumps(r["tools"]) if r.get("tools") else None,
                "chat_template_kwargs": r["chat_template_kwargs"]}
    pq.write_table(pa.Table.from_pylist([arrow_row(r) for r in rows]), parquet)
    for name, data in (("sharegpt", write_rows(tmp_path / "sg.jsonl", sharegpt)),
                       ("pretok", write_rows(tmp_path / "pt.jsonl", pretok)), ("parquet", parquet)):
        extract(tmp_path / name, data)
        assert_same_content(tmp_path / name, cache[0])


def test_rows_are_read_by_index(tmp_path, train_rows):
    """A shard's rows come from seeking to them: the same rows as a full pass, across files,
    blank lines included."""
    from pipeline.data.conversations import index_rows, iter_rows
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps(r) for r in train_rows[:7]) + "\n\n")
    b.write_text("\n" + "\n".join(json.dumps(r) for r in train_rows[7:20]) + "\n")
    index, malformed = index_rows([a, b])
    assert index.counts == [7, 13] and malformed == 0
    full = list(iter_rows([a, b]))
    for wanted in (range(0, 3), range(5, 12), range(7, 8), range(15, 20), {2, 9, 19}):
        got = list(iter_rows([a, b], wanted=wanted, index=index))
        want = [(r.sample_id, r.where, r.messages) for r in full if r.sample_id in wanted]
        assert [(r.sample_id, r.where, r.messages) for r in got] == want
