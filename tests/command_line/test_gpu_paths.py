"""Every GPU path of the pipeline run on the simulated accelerator (harness/simulated_device.py: a
device that is not the host, where mixing the two raises as on CUDA): eval greedy and sampled,
block and DDTree (tree and paths verification), one prompt and a batch, with the drafter's KV
cache; generate in-process; training steps under each objective; extract of a few rows;
verify-cache --recompute; an export reloaded. The reference is the same work on the host, in
float32 with the host's kernels: decoded tokens must be equal (and greedy's equal plain greedy
decoding); stored values, losses and weights equal within float32 rounding, since a tensor
subclass receives composite ops decomposed (`linear` as a transpose and a matmul) and so rounds
differently, as a GPU's kernels do."""

import json

import pytest
import torch

from harness.caches import assert_same_content
from harness.runs import write_rows
from harness.draft_vocab import with_draft_vocab
from harness.simulated_device import SimTensor, simulated_accelerator
from pipeline.config import ExtractConfig
from pipeline.data.prompts import read_prompts
from pipeline.drafter.export import load_drafter
from pipeline.drafter.vocab import DraftVocab
from pipeline.eval.batched import decode_rows
from pipeline.eval.speculative_decoding import block_decode, greedy, greedy_rows, tree_decode
from pipeline.sampler import draw
from pipeline.eval.speculative_sampling import SpeculativeSampler
from pipeline.target_model import end_of_turn_ids, frozen_target_modules, load_target
from pipeline.target_model.live import LiveTarget
from stages.eval.options import EvalOptions
from stages.eval.run import run_eval
from stages.extract.run import run_extract
from stages.generate.options import GenerateOptions
from stages.generate.run import run_generate
from stages.train.run import resolve_config, run_train
from stages.verify_cache.options import VerifyOptions
from stages.verify_cache.run import run_verify

MAX_NEW = 10
SAMPLED = SpeculativeSampler(temperature=1.0, top_p=0.9, seed=3)


def test_a_sampled_token_is_drawn_on_the_device():
    """The bug a GPU met first: `draw` built its search value on the host (every sampled eval on
    CUDA stopped at its first token)."""
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), -1)
    on_host = [draw(probs, u) for u in (0.0, 0.3, 0.999)]
    with simulated_accelerator() as sim:
        assert [draw(probs.to(sim.device), u) for u in (0.0, 0.3, 0.999)] == on_host


@pytest.fixture(scope="module")
def setting(trained_run, embedded, tokenizer):
    prompts = [p["ids"] for p in read_prompts(embedded.HELDOUT_DATA, tokenizer, 4)]
    return {"run": trained_run["run"], "prompts": prompts, "eos": end_of_turn_ids(tokenizer), "target_dir": embedded.TARGET_DIR}


def _decodings(setting, device, sampling, vocab=None):
    embed, head = frozen_target_modules(setting["target_dir"])
    drafter = load_drafter(setting["run"] / "drafter", embed=embed, lm_head=head)
    if vocab is not None:  # the trained drafter drafting from a draft vocabulary (scattered into V on the device)
        drafter = with_draft_vocab(drafter, vocab)
    drafter = drafter.to(device).eval()
    live = LiveTarget(load_target(setting["target_dir"], dtype=torch.float32).to(device), drafter.config.target_layer_ids)
    one, eos = setting["prompts"][:1], setting["eos"]
    out = {
        "block": [block_decode(live, drafter, p, max_new=MAX_NEW, eos=eos, sampling=sampling, row=i) for i, p in enumerate(one)],
        "tree": [tree_decode(live, drafter, p, max_new=MAX_NEW, eos=eos, budget=8, verify="tree", sampling=sampling, row=i)
                 for i, p in enumerate(one)],
        "paths": [tree_decode(live, drafter, p, max_new=MAX_NEW, eos=eos, budget=8, verify="paths", sampling=sampling, row=i)
                  for i, p in enumerate(one)],
        "block batch": decode_rows(live, drafter, setting["prompts"], max_new=MAX_NEW, eos=eos, sampling=sampling),
        "tree batch": decode_rows(live, drafter, setting["prompts"], max_new=MAX_NEW, eos=eos, budget=8, sampling=sampling),
        "plain batch": greedy_rows(live, setting["prompts"], max_new=MAX_NEW, eos=eos, sampling=sampling),
    }
    plain = [greedy(live, p, max_new=MAX_NEW, eos=eos, sampling=sampling, row=i).tokens for i, p in enumerate(setting["prompts"])]
    return {k: [(r.tokens, r.accepted) for r in v] for k, v in out.items()}, plain


@pytest.mark.parametrize("sampling, vocab", [(None, None), (SAMPLED, None), (SAMPLED, DraftVocab(torch.arange(0, 512, 2), 512))],
                         ids=["greedy", "sampled", "sampled-draft-vocab"])
def test_decoding_on_the_device_equals_the_host(setting, sampling, vocab):
    host, host_plain = _decodings(setting, torch.device("cpu"), sampling, vocab)
    with simulated_accelerator() as sim:
        device, device_plain = _decodings(setting, sim.device, sampling, vocab)
    assert device == host
    assert device_plain == host_plain
    assert [tokens for tokens, _ in host["plain batch"]] == host_plain   # greedy or sampled: a batch decodes as one prompt alone
    if sampling is None:   # lossless: every variant's tokens are plain greedy's
        for name, results in host.items():
            assert [tokens for tokens, _ in results] == host_plain[:len(results)], name
    assert any(sum(accepted) for _, accepted in host["block batch"]), "no draft was accepted: the paths after one were not run"


def test_sampled_eval_runs_on_the_device(setting):
    with simulated_accelerator():
        result = run_eval(EvalOptions(drafter=setting["run"], target=None, prompts=None, max_new_tokens=8,
                                      block_size=None, tree_budget=[4], tree_top_k=4, limit=2,
                                      batch_size=2, temperature=1.0, top_p=0.9))
    assert result["device"].startswith("meta")
    assert result["block"]["tokens"] > 0 and result["tree"]["4"]["tokens"] > 0


def test_generate_on_the_device_writes_what_the_host_writes(train_rows, tmp_path):
    data = write_rows(tmp_path / "convs.jsonl", train_rows[:3])
    for temperature, top_p in ((0.0, 1.0), (1.0, 0.9)):   # greedy takes no --top-p (pipeline/sampler.py)
        host_out, device_out = tmp_path / f"host-{temperature}.jsonl", tmp_path / f"device-{temperature}.jsonl"
        run_generate(GenerateOptions(data=[str(data)], out=host_out, turns="last", max_new_tokens=16,
                                     temperature=temperature, top_p=top_p, batch_size=3, device="cpu"))
        with simulated_accelerator():
            summary = run_generate(GenerateOptions(data=[str(data)], out=device_out, turns="last", max_new_tokens=16,
                                                   temperature=temperature, top_p=top_p,
                                                   batch_size=3))
        assert summary["num_rows"] == 3
        host = [json.loads(line)["messages"] for line in host_out.read_text().splitlines()]
        device = [json.loads(line)["messages"] for line in device_out.read_text().splitlines()]
        assert device == host, temperature


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, train_rows):
    """Four conversations extracted on the host and on the simulated device."""
    root = tmp_path_factory.mktemp("device-extract")
    data = write_rows(root / "convs.jsonl", train_rows[:4])
    run_extract(ExtractConfig(cache=str(root / "host"), data=[str(data)], num_shards=1), None, progress=False)
    with simulated_accelerator():
        run_extract(ExtractConfig(cache=str(root / "device"), data=[str(data)], num_shards=1), None, progress=False)
    return root


def test_bf16_training_takes_autocast_on_the_device_as_on_the_host(extracted, tmp_path):
    """`--dtype bfloat16` on the device: the step runs under autocast (CUDA's op lists, the frozen
    embedding and head in bf16), as a GPU's does. The reference is the host's run under torch's
    CPU autocast; the two lists differ for softmax and reductions (float32 on CUDA, bf16 on the
    CPU), so the losses agree to bf16's precision, not bit for bit."""
    def train(out, device_run):
        cfg, preset_target = resolve_config(None, {"cache": str(extracted / "host"), "out": str(out), "max_steps": 2,
                                                   "log_every": 1, "batch_sequences": 2, "num_anchors": 32,
                                                   "dtype": "bfloat16"})
        if device_run:
            with simulated_accelerator():
                run_train(cfg, preset_target=preset_target, warn=lambda *_: None)
        else:
            run_train(cfg, preset_target=preset_target, warn=lambda *_: None)
        record = json.loads((out / "run.json").read_text())
        return record, [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]

    (device_record, device), (host_record, host) = train(tmp_path / "device", True), train(tmp_path / "host", False)
    for record in (device_record, host_record):
        assert (record["autocast"], record["frozen_dtype"]) == ("torch.bfloat16", "bfloat16"), record
    assert device == pytest.approx(host, rel=2e-2)


def test_extract_on_the_device_stores_what_the_host_stores_and_verifies(extracted):
    # ids and masks exact, predictions' ids 99%, values within rtol 0.02 (harness/caches.py)
    assert_same_content(extracted / "host", extracted / "device", exact=False, atol=1e-3)
    with simulated_accelerator():
        result = run_verify(VerifyOptions(cache=extracted / "device", recompute=2))
    statuses = {c["check"]: c["status"] for c in result["checks"]}
    assert statuses["recompute"] == statuses["tail_recompute"] == "pass", statuses
    assert "fail" not in statuses.values(), statuses


@pytest.mark.parametrize("objective", [{"loss": "ce", "position_weight": "dpace"},
                                       {"loss": "kl + 0.5*tv + 0.2*nla + 0.1*lk"}, {"loss": "kl", "draft_vocab": 48}],
                         ids=["ce-dpace", "soft-terms", "kl-draft-vocab"])
def test_training_on_the_device_logs_the_hosts_losses_and_exports_the_same_drafter(extracted, tmp_path, embedded, objective):
    def train(out, device_run):
        settings = {"cache": str(extracted / "host"), "out": str(out), "max_steps": 3, "log_every": 1, "batch_sequences": 2,
                    "num_anchors": 32, **objective}
        cfg, preset_target = resolve_config(None, settings)
        if device_run:
            with simulated_accelerator():
                summary = run_train(cfg, preset_target=preset_target, warn=lambda *_: None)
            assert summary["device"] == "meta"
        else:
            run_train(cfg, preset_target=preset_target, warn=lambda *_: None)
        return [{k: row[k] for k in ("step", "loss", "ce", "grad_norm", "accuracy")}
                for row in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())]

    device, host = train(tmp_path / "device", True), train(tmp_path / "host", False)
    assert [r["step"] for r in device] == [r["step"] for r in host] == [1, 2, 3]
    for d, h in zip(device, host):
        assert {k: d[k] for k in ("loss", "ce", "grad_norm")} == pytest.approx({k: h[k] for k in ("loss", "ce", "grad_norm")},
                                                                              rel=1e-4)
        assert d["accuracy"] == pytest.approx(h["accuracy"], abs=0.02)
    embed, head = frozen_target_modules(embedded.TARGET_DIR)
    host_weights = load_drafter(tmp_path / "host" / "drafter", embed=embed, lm_head=head).state_dict()
    exported = load_drafter(tmp_path / "device" / "drafter", embed=embed, lm_head=head)   # strict: every key, every shape
    for k, v in host_weights.items():
        torch.testing.assert_close(exported.state_dict()[k], v, atol=1e-3, rtol=1e-3, msg=k)
    with simulated_accelerator() as sim:
        moved = exported.to(sim.device)
        assert all(isinstance(p, SimTensor) for p in moved.parameters())
