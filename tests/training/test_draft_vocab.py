"""A draft vocabulary (issue 58, DESIGN 3.4): the chosen set against a plain count over the cache,
the tokens a vocabulary always keeps (the embedded tokenizer's reserved tokens; the real Qwen3.6
tokenizer's byte fallbacks), the loss with K = V equal to today's bit for bit, the loss, its
gradients and the metrics with K < V against a plain full-vocabulary computation with the
excluded logits removed, and the export in the format vLLM and speculators read. Issue 69: a run
counts the cache once (rank 0 alone under torchrun; a resume not at all), and cache-info sizes K
at the max_length train resolves."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.loss_batches import V, batch, drafter
from harness.draft_vocab import with_draft_vocab
from harness.runs import REPO
from harness.prerequisites import needs
from pipeline.cache.reader import open_cache
from pipeline.drafter.export import export_drafter, load_drafter
from pipeline.training.batch import final_hidden, forward_logits
from pipeline.drafter.vocab import DraftVocab
from pipeline.errors import PipelineError
from pipeline.training.draft_vocab import choose, choose_draft_vocab, count_labels, coverage, reserved_ids
from pipeline.training.loss import supervised_loss
from pipeline.training.metrics import finish_metrics, hit_sums

QWEN_TOKENIZER = REPO.parent / "shared" / "fixtures" / "tokenizers" / "qwen3.6"


def plain_count(cache, vocab_size: int, max_length: int) -> Counter:
    """The labels of supervised slots, sample by sample, written from DESIGN 3.3: position t
    (1 <= t < max_length) with loss_mask[t] = 1 has label target_argmax[t-1]."""
    reader = open_cache(cache)
    counts = Counter()
    for name in reader.shards:
        shard = reader.shard(name)
        for sid in shard.sample_ids:
            argmax, mask = shard.read("target_argmax", int(sid)), shard.read("loss_mask", int(sid))
            for t in range(1, min(len(mask), max_length)):
                if mask[t]:
                    counts[int(argmax[t - 1])] += 1
    return counts


@pytest.mark.parametrize("max_length", [3072, 40])
def test_the_vocabulary_is_the_most_predicted_labels_of_a_plain_count(twelve_rows_cache, tokenizer, max_length):
    cache = twelve_rows_cache["cache"]
    want = plain_count(cache, 512, max_length)
    reader = open_cache(cache)
    got = count_labels(reader, 512, max_length)
    assert {i: int(c) for i, c in enumerate(got) if c} == dict(want)

    mask_id = tokenizer.convert_tokens_to_ids("<|MASK|>")
    vocab, record = choose_draft_vocab(reader, tokenizer, size=40, vocab_size=512, mask_id=mask_id, max_length=max_length)
    reserved = {i for i in tokenizer.added_tokens_decoder if i != mask_id}
    assert len(reserved) == 9
    ranked = [i for i in sorted(range(512), key=lambda i: (-want[i], i)) if i not in reserved]
    assert set(vocab.ids.tolist()) == reserved | set(ranked[:40 - len(reserved)])
    assert mask_id not in vocab.ids.tolist()
    assert record["coverage"] == pytest.approx(sum(want[i] for i in vocab.ids.tolist()) / sum(want.values()), abs=1e-6)
    assert record["labels_counted"] == sum(want.values()) and record["size"] == 40 and record["reserved"] == 9
    assert record["sha256"] == vocab.digest()


def test_ties_go_to_the_smaller_id_and_kept_tokens_count_first():
    counts = np.array([5, 0, 7, 5, 5, 1])
    assert choose(counts, 3, keep=[1]).tolist() == [0, 1, 2]     # 1 kept; then 2 (7), then 0 (5, smallest id of three)
    assert choose(counts, 4, keep=[]).tolist() == [0, 2, 3, 4]
    assert coverage(counts, np.array([0, 2])) == pytest.approx(12 / 23)
    with pytest.raises(PipelineError, match="smaller than the 2 tokens"):
        choose(counts, 1, keep=[1, 5])


@needs(QWEN_TOKENIZER.is_dir(), f"the real Qwen3.6 tokenizer is not at {QWEN_TOKENIZER} (the project's shared fixtures folder)")
def test_byte_fallbacks_and_reserved_tokens_of_the_real_tokenizer_are_kept():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QWEN_TOKENIZER)
    kept = reserved_ids(tokenizer, mask_id=248070, vocab_size=248320, size=32768)
    assert len(kept["bytes"]) == 256
    # Every printable ASCII character and a byte no UTF-8 text starts with encode to a kept token.
    singles = [tokenizer.encode(chr(c), add_special_tokens=False) for c in range(0x20, 0x7F)]
    assert all(len(ids) == 1 and ids[0] in kept["bytes"] for ids in singles)
    assert {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "<think>", "</think>",
                                                          "<tool_call>", "</tool_call>")} <= set(kept["reserved"])
    assert 248070 not in kept["reserved"]
    assert reserved_ids(tokenizer, mask_id=248070, vocab_size=248320, size=1024)["bytes"] == []   # K < 2048


def _batch(vocab=None, soft=False):
    return batch(soft, vocab=vocab)


def _train_pass(model, packed, soft):
    final = final_hidden(model, packed)
    loss, hits = supervised_loss(final, model.lm_head_weight, packed.labels, packed.weights, with_hits=True,
                                 soft_ids=packed.soft_ids if soft else None, soft_probs=packed.soft_probs if soft else None)
    loss.backward()
    return loss, hit_sums(hits, packed.weights, packed.real_blocks, packed.outside), \
        {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("soft", [False, True])
def test_the_whole_vocabulary_as_a_draft_vocabulary_changes_no_bit(soft):
    whole = DraftVocab(torch.arange(V), V)
    loss, sums, grads = _train_pass(drafter(), _batch(soft=soft), soft)
    loss_v, sums_v, grads_v = _train_pass(with_draft_vocab(drafter(), whole), _batch(whole, soft), soft)
    assert torch.equal(loss, loss_v)
    assert all(torch.equal(sums[k], sums_v[k]) for k in sums) and float(sums_v["outside"]) == 0
    assert all(torch.equal(grads[k], grads_v[k]) for k in grads)


def _reference(model, ids: torch.Tensor, soft: bool):
    """Loss sum, metrics and gradients the plain way: full-vocabulary logits of the dense forward,
    the columns outside `ids` removed, labels (target ids) outside `ids` out of the loss and
    missed in the metrics; soft targets kept inside `ids` and renormalised."""
    packed = _batch(soft=soft)
    logits = forward_logits(model, packed)[..., ids]                     # [A, B, K]
    logq = torch.log_softmax(logits.float(), dim=-1)
    position = {int(t): j for j, t in enumerate(ids)}
    draft_label = torch.tensor([position.get(int(t), -1) for t in packed.labels.flatten()]).view(packed.labels.shape)
    supervised = packed.weights > 0
    inside = supervised & (draft_label >= 0)
    w = torch.where(inside, packed.weights, torch.zeros_like(packed.weights))
    if soft:
        keep = torch.isin(packed.soft_ids, ids)
        p = packed.soft_probs * keep
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        cols = torch.tensor([[position.get(int(t), 0) for t in row] for row in packed.soft_ids.view(-1, packed.soft_ids.shape[-1])]
                            ).view(packed.soft_ids.shape)
        per = (p * (torch.log(p.clamp_min(1e-30)) - logq.gather(-1, cols))).sum(-1)
    else:
        per = -logq.gather(-1, draft_label.clamp_min(0)[..., None])[..., 0]
    loss = (per * w).sum()
    loss.backward()
    top1 = ids[logits.argmax(-1)] == packed.labels
    accuracy = float((top1 & inside).sum()) / float(supervised.sum())
    return loss, accuracy, float((supervised & ~inside).sum()) / float(supervised.sum()), \
        {n: q.grad.clone() for n, q in model.named_parameters()}


@pytest.mark.parametrize("soft", [False, True])
def test_the_loss_with_k_below_v_is_the_full_vocabulary_one_with_the_excluded_logits_removed(soft):
    ids = torch.from_numpy(np.sort(np.random.default_rng(3).permutation(V - 1)[:120]))
    want_loss, want_acc, want_outside, want_grads = _reference(drafter(), ids, soft)
    assert 0.3 < want_outside < 0.8                        # both kinds of slot occur
    loss, sums, grads = _train_pass(with_draft_vocab(drafter(), DraftVocab(ids, V)), _batch(DraftVocab(ids, V), soft), soft)
    metrics = finish_metrics(sums)
    torch.testing.assert_close(loss.double(), want_loss.double(), rtol=1e-5, atol=1e-5)
    assert metrics["accuracy"] == pytest.approx(want_acc) and metrics["outside_vocab"] == pytest.approx(want_outside)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-5)  # sums over ~800 slots


def test_the_export_carries_d2t_t2d_and_the_head_rows_as_vllm_reads_them(tmp_path):
    base = drafter()
    ids = torch.tensor([0, 3, 4, 17, 90, 200, 299])
    model = with_draft_vocab(base, DraftVocab(ids, V)).eval()
    export_drafter(model, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["draft_vocab_size"] == 7 and config["vocab_size"] == V
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert d2t.dtype == torch.int64 and torch.equal(torch.arange(7) + d2t, ids)         # vLLM: targets = base + d2t
    assert t2d.dtype == torch.bool and t2d.shape == (V,) and torch.equal(t2d.nonzero()[:, 0], ids)
    assert torch.equal(tensors["lm_head.weight"], base.lm_head_weight[ids])

    loaded = load_drafter(tmp_path / "d", embed=base._frozen["embed"], lm_head=base._frozen["lm_head"]).eval()
    x = torch.randn(5, 48)
    logits = loaded.target_logits(x)
    assert torch.equal(logits[:, ids], x @ base.lm_head_weight[ids].t())
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(logits[:, outside]).all())

    in_bf16 = torch.nn.Linear(48, V, bias=False).to(torch.bfloat16)   # an fp32 export evaluated in bf16
    in_bf16.weight.data.copy_(base.lm_head_weight)
    assert load_drafter(tmp_path / "d", embed=base._frozen["embed"], lm_head=in_bf16).lm_head_weight.dtype == torch.bfloat16
    other = torch.nn.Linear(48, V, bias=False)
    with pytest.raises(PipelineError, match="trained against another target"):
        load_drafter(tmp_path / "d", embed=base._frozen["embed"], lm_head=other)
    tensors["d2t"] = tensors["d2t"].flip(0)
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(PipelineError, match="d2t: draft vocabulary: ids must be sorted"):
        load_drafter(tmp_path / "d", embed=base._frozen["embed"], lm_head=base._frozen["lm_head"])


def test_train_with_a_draft_vocabulary_records_it_resumes_only_with_it_and_eval_stays_lossless(twelve_rows_cache, tmp_path):
    """`pipeline train --draft-vocab` end to end: run.json records the vocabulary, the log its
    outside share, the export its d2t, the report both, and cache-info sizes K the same way before training; bad K values are one-line errors; a resume with another K
    or another vocabulary in the checkpoint is refused; eval of the export is identical to greedy."""
    import shutil

    from harness.runs import cli_here

    cache, run = str(twelve_rows_cache["cache"]), tmp_path / "run"
    common = ("train", "--cache", cache, "--batch-sequences", "4", "--log-every", "1", "--checkpoint-every", "1")
    for k, message in (("4", "draft_vocab must be >= 8"), ("512", "below the target's vocabulary of 512")):
        bad = cli_here(*common, "--out", str(tmp_path / f"bad{k}"), "--max-steps", "1", "--draft-vocab", k)
        assert bad.returncode != 0 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert not (tmp_path / f"bad{k}" / "drafter").exists()

    done = cli_here(*common, "--out", str(run), "--max-steps", "2", "--draft-vocab", "64")
    assert done.returncode == 0, done.stderr
    record = json.loads((run / "run.json").read_text())["draft_vocab"]
    assert record["size"] == 64 and 0.5 < record["coverage"] <= 1 and record["reserved"] == 9
    lines = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert all(0 <= line["outside_vocab"] < 1 for line in lines)
    assert json.loads((run / "drafter" / "config.json").read_text())["draft_vocab_size"] == 64
    d2t = load_file(str(run / "drafter" / "model.safetensors"))["d2t"]
    assert (torch.arange(64) + d2t).tolist() == sorted(set((torch.arange(64) + d2t).tolist()))

    info = cli_here("cache-info", cache, "--draft-vocab", "64,300", "--json")     # sizing K before training
    assert info.returncode == 0, info.stderr
    sized = json.loads(info.stdout)["draft_vocab"]
    assert sized["rows"][0] == {"size": 64, "coverage": record["coverage"], "reserved": 9, "byte_fallbacks": 0}
    assert sized["rows"][1]["coverage"] == 1.0 and sized["labels"] == record["labels_counted"]
    report = cli_here("report", str(run), "--json")
    assert report.returncode == 0, report.stderr
    shown = json.loads(report.stdout)["runs"][0]["draft_vocab"]
    assert shown == {"size": 64, "target_size": 512, "coverage": record["coverage"], "outside_vocab_last": lines[-1]["outside_vocab"]}

    other_k = cli_here(*common, "--out", str(run), "--max-steps", "2", "--draft-vocab", "65")
    assert other_k.returncode != 0 and "draft_vocab: 64 -> 65" in other_k.stderr
    tampered = tmp_path / "tampered"
    shutil.copytree(run, tampered)
    last = sorted((tampered / "checkpoints").iterdir())[-1] / "drafter" / "model.safetensors"
    tensors = load_file(str(last))
    ids = torch.arange(64) + tensors["d2t"]
    ids[-1] = 511 if int(ids[-1]) != 511 else 510
    ids = ids.sort().values
    tensors["d2t"], tensors["t2d"] = ids - torch.arange(64), torch.isin(torch.arange(512), ids)
    save_file(tensors, str(last))
    refused = cli_here(*common, "--out", str(tampered), "--max-steps", "2", "--draft-vocab", "64")
    assert refused.returncode != 0 and "draft vocabulary" in refused.stderr and "is not this run's" in refused.stderr

    ev = cli_here("eval", "--drafter", str(run), "--limit", "2", "--max-new-tokens", "12", "--tree-budget", "4", "--json")
    assert ev.returncode == 0, ev.stderr
    result = json.loads(ev.stdout)
    assert result["block"]["identical_to_greedy"] == 2 and result["tree"]["4"]["identical_to_greedy"] == 2


# --------------------------------------------------------------------------- chosen once per run (issue 69)

VOCAB_RUN = ("--max-steps", "2", "--batch-sequences", "4", "--log-every", "1", "--checkpoint-every", "1",
             "--draft-vocab", "64", "--json")


def label_files(cache) -> set[Path]:
    """Every chunk file of the cache's label arrays: what counting the vocabulary opens."""
    return {p.resolve() for a in ("target_argmax", "loss_mask") for p in Path(cache).glob(f"shard-*/{a}/c.*")}


def train_log(run) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def vocab_run(twelve_rows_cache, tmp_path_factory):
    """One process, --draft-vocab 64, 2 steps with a checkpoint after each: the reference the
    two-rank run and the resumes are compared with. Tests copy it before writing."""
    from harness.runs import cli_here

    run = tmp_path_factory.mktemp("vocab") / "run"
    done = cli_here("train", "--cache", str(twelve_rows_cache["cache"]), "--out", str(run), *VOCAB_RUN)
    assert done.returncode == 0, done.stderr
    return run


def test_only_rank_0_counts_and_every_rank_drafts_from_its_vocabulary(twelve_rows_cache, vocab_run, tmp_path):
    """Two gloo ranks: the label files opened to count (a Python audit hook in each process,
    harness/label_reads.py) are rank 0's alone, each of the cache's once at least; rank 1 opens
    labels only for its batches. Both ranks draft from the one-process run's vocabulary: the
    run logs what one process logs (a rank with other ids would put other labels in the loss)."""
    from harness.label_reads import label_reads, label_reads_env
    from harness.runs import torchrun

    cache, run = twelve_rows_cache["cache"], tmp_path / "run"
    result = torchrun(2, "train", "--cache", str(cache), "--out", str(run), *VOCAB_RUN,
                      env=label_reads_env(tmp_path / "reads"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reads = label_reads(tmp_path / "reads")
    assert {Path(p).resolve() for p in reads[0]["counting"]} == label_files(cache)
    assert reads[1]["counting"] == [] and reads[1]["other"], reads[1]
    record, reference = (json.loads((r / "run.json").read_text()) for r in (run, vocab_run))
    assert record["world_size"] == 2 and record["draft_vocab"] == reference["draft_vocab"]
    two, one = train_log(run), train_log(vocab_run)
    assert [x["step"] for x in two] == [y["step"] for y in one] == [1, 2]
    for x, y in zip(two, one):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5) and x["outside_vocab"] == pytest.approx(y["outside_vocab"])
        assert x["accuracy"] == pytest.approx(y["accuracy"], abs=1e-6)


def test_a_refusal_on_rank_0_stops_every_rank_with_its_line(twelve_rows_cache, tmp_path):
    """K = 8 is below the embedded tokenizer's 9 reserved tokens: rank 0's refusal reaches rank 1,
    which stops with the same line instead of waiting for the vocabulary."""
    from harness.runs import torchrun

    result = torchrun(2, "train", "--cache", str(twelve_rows_cache["cache"]), "--out", str(tmp_path / "run"),
                      "--max-steps", "1", "--draft-vocab", "8", timeout=300)
    errors = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 2 and len(set(errors)) == 1, result.stderr[-3000:]
    assert "--draft-vocab 8: smaller than the 9 tokens a vocabulary keeps" in errors[0]


def test_a_resume_takes_the_vocabulary_from_its_checkpoint_without_counting(twelve_rows_cache, vocab_run, tmp_path):
    """Resumed from step 1, the run opens no label file to count (it opens them to train step 2),
    keeps run.json's record as it was and logs step 2 as the uninterrupted run did."""
    from harness.label_reads import label_reads, label_reads_env
    from harness.runs import cli

    run = tmp_path / "run"
    shutil.copytree(vocab_run, run)
    shutil.rmtree(run / "checkpoints" / "step-00000002")
    shutil.rmtree(run / "drafter")
    resumed = cli("train", "--cache", str(twelve_rows_cache["cache"]), "--out", str(run), *VOCAB_RUN,
                  env={**label_reads_env(tmp_path / "reads"), "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reads = label_reads(tmp_path / "reads")
    assert reads[0]["counting"] == [] and reads[0]["other"], reads
    record, reference = (json.loads((r / "run.json").read_text()) for r in (run, vocab_run))
    assert record["resumed_from_step"] == 1 and record["draft_vocab"] == reference["draft_vocab"]
    assert [x["step"] for x in train_log(run)] == [1, 2]
    assert train_log(run)[1]["loss"] == pytest.approx(train_log(vocab_run)[1]["loss"], rel=1e-6)


def test_a_resume_needs_no_readable_label(twelve_rows_cache, vocab_run, tmp_path):
    """The same cache with every label chunk zeroed (its records untouched, so the resume's cache
    check passes): counting it fails on the first checksum, yet a resume from the last checkpoint
    (the export still to write) succeeds with the checkpoint's vocabulary and run.json's record."""
    from harness.runs import cli_here

    cache = tmp_path / "cache"
    shutil.copytree(twelve_rows_cache["cache"], cache)
    for f in label_files(cache):
        f.write_bytes(bytes(f.stat().st_size))
    fresh = cli_here("train", "--cache", str(cache), "--out", str(tmp_path / "fresh"), *VOCAB_RUN)
    assert fresh.returncode != 0 and "CRC32C mismatch" in fresh.stderr, fresh.stderr

    run = tmp_path / "run"
    shutil.copytree(vocab_run, run)
    shutil.rmtree(run / "drafter")
    resumed = cli_here("train", "--cache", str(cache), "--out", str(run), *VOCAB_RUN)
    assert resumed.returncode == 0, resumed.stderr
    record = json.loads((run / "run.json").read_text())
    assert record["resumed_from_step"] == 2
    assert record["draft_vocab"] == json.loads((vocab_run / "run.json").read_text())["draft_vocab"]
    exported = load_file(str(run / "drafter" / "model.safetensors"))["d2t"]
    assert DraftVocab.from_d2t(exported, 512).digest() == record["draft_vocab"]["sha256"]


def test_a_decision_on_rank_0_reaches_every_rank_and_so_does_its_failure(tmp_path):
    """pipeline.distributed.decided_on_rank0 on two gloo ranks (tests/training/rank0_decision_worker.py):
    only rank 0 runs the decision; its result, its refusal's line, or a line naming its bug (rank
    0 keeps the bug's own exception) reach rank 1, which never waits for a broadcast that is not sent."""
    import os
    import subprocess
    import sys

    from harness.ports import free_port

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(Path(__file__).parent / "rank0_decision_worker.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert {case: report["ran"] for case, report in zero.items()} == {"succeeds": 1, "refuses": 1, "fails": 1}
    assert {case: report["ran"] for case, report in one.items()} == {"succeeds": 0, "refuses": 0, "fails": 0}
    assert zero["succeeds"]["result"] == one["succeeds"]["result"] == {"ids": [3, 5, 8], "from_rank": 0}
    refusal = "--draft-vocab 8: smaller than the 9 tokens a vocabulary keeps"
    assert zero["refuses"]["PipelineError"] == one["refuses"]["PipelineError"] == refusal
    assert zero["fails"]["ZeroDivisionError"] == "integer division or modulo by zero"
    assert one["fails"]["PipelineError"] == "rank 0 failed while testing (ZeroDivisionError: integer division or modulo by zero)"


# --------------------------------------------------------------------------- cache-info sizes K as train will


@pytest.fixture(scope="module")
def long_rows_cache(tmp_path_factory, train_rows):
    """Two samples of 10 conversations each (about 800 tokens, 200 supervised past token 512): the
    shipped rows alone never pass the tiny preset's max_length of 512."""
    from harness.runs import write_rows
    from pipeline.config import ExtractConfig
    from stages.extract.run import run_extract

    plain = [r for r in train_rows if not r.get("tools") and r["messages"][0]["role"] == "user"
             and r["chat_template_kwargs"]["enable_thinking"]]
    rows = [{"id": f"long-{i}", "chat_template_kwargs": {"enable_thinking": True},
             "messages": [m for r in plain[10 * i:10 * (i + 1)] for m in r["messages"]]} for i in range(2)]
    root = tmp_path_factory.mktemp("long")
    data = write_rows(root / "convs.jsonl", rows)
    run_extract(ExtractConfig(cache=str(root / "cache"), data=[str(data)], num_shards=1), None, progress=False)
    return root / "cache"


def test_cache_info_counts_the_labels_train_counts(long_rows_cache, tmp_path):
    """cache-info --draft-vocab gives the coverage and label count that train records in run.json
    for the same K on the same cache: at the preset's max_length (512 for tiny; it counted at
    3,072 before), at a TOML config's, and at --max-length's against a plain count."""
    from harness.runs import cli_here

    cache = str(long_rows_cache)
    assert sum(plain_count(cache, 512, 3072).values()) > sum(plain_count(cache, 512, 512).values())  # a cut that matters
    toml = tmp_path / "train.toml"
    toml.write_text("[train.data]\nmax_length = 300\n")
    for extra, length, source in (((), 512, "preset tiny"), (("--config", str(toml)), 300, str(toml))):
        run = tmp_path / f"run{length}"
        done = cli_here("train", "--cache", cache, "--out", str(run), "--max-steps", "1", "--batch-sequences", "2",
                        "--draft-vocab", "64", *extra)
        assert done.returncode == 0, done.stderr
        recorded = json.loads((run / "run.json").read_text())
        assert recorded["config"]["data"]["max_length"] == length
        info = cli_here("cache-info", cache, "--draft-vocab", "64", *extra, "--json")
        assert info.returncode == 0, info.stderr
        sized = json.loads(info.stdout)["draft_vocab"]
        assert sized["rows"][0]["coverage"] == recorded["draft_vocab"]["coverage"]
        assert sized["labels"] == recorded["draft_vocab"]["labels_counted"]
        assert (sized["max_length"], sized["max_length_from"]) == (length, source)

    info = cli_here("cache-info", cache, "--draft-vocab", "64", "--max-length", "40", "--json")
    sized = json.loads(info.stdout)["draft_vocab"]
    assert (sized["max_length"], sized["max_length_from"]) == (40, "--max-length")
    assert sized["labels"] == sum(plain_count(cache, 512, 40).values())
    alone = cli_here("cache-info", cache, "--max-length", "40")
    assert alone.returncode != 0 and "pass --draft-vocab K too" in alone.stderr

