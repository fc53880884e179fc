"""`python benchmarks/gpu/gpu_check.py --smoke`: the first-GPU-hour script's every section runs at toy
sizes on the CPU and lands in one JSON summary; what a CPU cannot have (fla, causal-conv1d, the
flagship-width target) is one line, never a crash; the training part compares flex attention
with split attention and counts flex attention's compiled graphs."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("extract", "kernels", "equality", "flagship_steps", "draft_vocab_steps", "loss_kernels", "train_and_eval",
            "generate")


def test_smoke_runs_every_section_into_one_summary(tmp_path):
    out = tmp_path / "gpu_check.json"
    run = subprocess.run([sys.executable, "benchmarks/gpu/gpu_check.py", "--smoke", "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["failed"] == [], {name: summary[name] for name in summary["failed"]}
    for name in SECTIONS:
        assert name in summary and f"{name}_wall_s" in summary, name
    # one line per section while it runs, then the summary
    streamed = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"')]
    assert [next(iter(line)) for line in streamed] == list(SECTIONS)
    assert summary["extract"]["tokens"] > 0 and set(summary["extract"]["kernel_path_per_shard"].values()) == {"torch"}
    embedded = summary["kernels"]["embedded"]
    assert set(embedded["bound"].values()) == {"torch"} and embedded["calls"]["chunk_gated_delta_rule"] > 0
    assert summary["kernels"]["flagship_width"].startswith("skipped")
    assert summary["kernels"]["ops"].startswith("skipped")   # fla op by op: a GPU's (tests/kernels on a CPU)
    evaluated = summary["train_and_eval"]
    assert evaluated["greedy"]["lossless"] is True and evaluated["sampled"]["block"]["tau"] >= 1
    assert summary["generate"]["rows"] == 4
    assert [r["draft_vocab"] for r in summary["draft_vocab_steps"]] == [512, 128, 64]
    assert all(r["fits"] and r["loss"] > 0 for r in summary["draft_vocab_steps"])
    assert summary["packages"]["flash-linear-attention"] == "not installed"   # a CPU machine has no GPU kernels
    assert "peak_rss_GiB_process" in summary["extract"]
    # flex attention against split (issue 67): eager on the CPU, its backward through the test scaffold
    equality = summary["equality"]
    assert equality["flex"]["loss_rel_diff"] < 1e-6 and equality["flex"]["max_rel_grad_diff"] < 1e-4
    compared = equality["flex_vs_split"]
    assert [(r["sequences"], r["tokens"], r["anchors"]) for r in compared["shapes"]] == [
        (2, 160, 8), (1, 128, 6), (3, 192, 10), (2, 144, 7)]
    assert all(r["loss_rel_diff"] < 1e-6 and 0 < r["max_rel_grad_diff"] < 1e-4 for r in compared["shapes"])
    # counted on the compiled path only: none on the CPU, where flex runs eager
    assert compared["flex"] == "eager (CPU)"
    assert compared["flex_graphs_compiled"] == {"create_block_mask": 0, "flex_attention": 0}
    assert all(r["flex_graphs_compiled"] == {"create_block_mask": 0, "flex_attention": 0}
               for r in summary["flagship_steps"])
