"""A checkpoint's optimizer state with several ranks: gathered tensor by tensor to rank 0
(pipeline.training.plan.gathered_state) rather than by torch's consolidate_state_dict, which
pickles and broadcasts every rank's state to every rank (issue 40: 5.4 GB more a rank at hidden
5120). The reference is torch's own consolidation of the same optimizer, on real gloo ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

from harness.ports import free_port

TESTS = Path(__file__).resolve().parent


def test_gathered_state_equals_torchs_consolidation(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(TESTS / "zero_gather_worker.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "result.json").read_text())
    assert len(report["owned"]) == 2 and min(report["owned"]) >= 1 and sum(report["owned"]) == 5
    assert report["0"] == {"groups": True, "keys": True, "tensors": True, "params_with_state": 0}
    for step in ("1", "2"):  # every parameter has state, split over the two ranks
        assert report[step] == {"groups": True, "keys": True, "tensors": True, "params_with_state": 5}
