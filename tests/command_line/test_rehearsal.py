"""The flagship dress rehearsal, small (issue 40): benchmarks/flagship/rehearsal.py end to end at Qwen3.6-27B's
real widths with 8 layers and 2 agent sessions (about 570 and 800 tokens), two training ranks.
Opt-in (DFLASH_SLOW=1): over an hour on 2 cores (on 2026-12-04, beside other test runs, it was still at
verify-cache fp8 after 60 minutes: target 130 s, extract tp 1 575 s, verify-cache bf16 about 11 minutes),
20 GB of memory, 30 GB of disk (an 11 GB target, two runs' checkpoints); run it alone.
Where z-lab's reference is installed (`pip install --no-deps dflash==0.1.0`, as the README's test
command does), the export's strict load into its class is checked too."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from harness.runs import REPO

# The per-stage table (wall times, peak memory, the machine's CPU and bf16 support above it) is kept
# when the test passes: written here, and printed past pytest's capture at the end.
TABLE = "rehearsal-stages.md"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DFLASH_SLOW") != "1", reason="the flagship rehearsal (over an hour, 20 GB); DFLASH_SLOW=1")
def test_every_stage_flows_at_the_flagship_widths(tmp_path, capsys):
    table = tmp_path / TABLE
    done = subprocess.run([sys.executable, "benchmarks/flagship/rehearsal.py", "--rows", "2", "--longest", "800",
                           "--train-ranks", "2", "--work", str(tmp_path / "work"), "--table", str(table)],
                          cwd=REPO, capture_output=True, text=True, timeout=3 * 3600)
    with capsys.disabled():   # shown on success too: the times are what a passing run is run for
        print(f"\n{table}:\n{table.read_text() if table.is_file() else '(not written)'}")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    summary = json.loads(done.stdout)["summary"]
    assert summary["machine"]["cpu"] and set(summary["machine"]["bf16"]) == {"avx512_bf16", "amx_bf16"}
    assert summary["stage_one"]["dry_run_raw_bytes_per_token"] == 4 + 1 + 4 + 32 * 8 + 4 + 5 * 5120 * 2
    assert summary["verify_bf16"]["recompute"] == "pass" and summary["verify_fp8"]["recompute"] == "pass"
    assert "fail" not in summary["verify_bf16"].values() and "fail" not in summary["verify_fp8"].values()
    agreement = summary["agreement"]
    # bf16 rounding in another reduction order, not a different computation (BENCHMARKS, issue 40).
    assert max(agreement["tp1_vs_forward"]["tap_rel_err"]) < 0.02 and max(agreement["tp8_vs_tp1"]["tap_rel_err"]) < 0.05
    assert agreement["tp8_vs_forward"]["argmax_shortfall"] < 0.4
    two = summary["stage_two"]
    assert [s["world_size"] for s in two["segments"]] == [2, 2, 1]
    assert [s["resumed_from_step"] or 0 for s in two["segments"]] == [0, 2, 4]  # killed after complete checkpoints
    assert two["steps"] == list(range(1, 7)) and two["max_rel_loss_diff"] < 1e-2
    assert summary["export"]["missing_keys"] == []
    if importlib.util.find_spec("dflash") is not None:
        assert summary["export"]["reference_class"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    stages = {s["stage"]: s for s in json.loads(done.stdout)["stages"]}
    assert len(stages["extract tp 8 bf16 (bucket)"]["ranks"]) == 8  # each rank's peak memory
    assert len(stages["train 2 rank(s), killed after its step-2 checkpoint"]["ranks"]) == 2
    ev = summary["eval"]  # in bf16 an output may part from greedy at a tie of the target (pipeline/eval/ties.py)
    assert ev["lossless"] and ev["block_identical"] + ev["block_departed_at_ties"] == 2
    assert ev["tree_identical"] + ev["tree_departed_at_ties"] == 2
