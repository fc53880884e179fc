"""The tap basis's fit (issue 77.4): its peak memory and time, before (a full float64
eigendecomposition of the moment with torch, where the moment lives: the target's device) and
after (pipeline/projection/basis.py: the moment on the host, the top R eigenpairs only, through
LAPACK's MRRR driver in place).

    python benchmarks/projection/fit_memory.py [--dims 3200,6400,12800] [--methods before,after]
        [--rank-fraction 0.25]

Each (D, method) runs in a process of its own: it builds a D x D float64 moment (a symmetric
matrix with a decaying diagonal: the fit's cost does not depend on the values), resets the
kernel's high-water mark (/proc/self/clear_refs), fits, and reports the peak resident memory
above what the moment itself holds, and the seconds. On a CPU the host is the device, so
"before" measures on the host what the old fit allocated on the GPU; the GPU figure is that
projection (cuSOLVER's syevd needs a workspace of the same order as LAPACK's). Linux only.
Prints one JSON document, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.cli_args import positive_ints  # noqa: E402


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(dim: int, method: str, projected_rank: int) -> dict:
    import torch

    from pipeline.projection.basis import SecondMoment, fit_basis

    torch.manual_seed(0)
    moment = torch.randn(dim, dim, dtype=torch.float64).mul_(1e-3)
    moment.add_(moment.T.clone()).diagonal().add_(torch.logspace(3, -3, dim, dtype=torch.float64))
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here on
    held = _status("VmRSS")
    start = time.perf_counter()
    if method == "before":  # the fit before issue 77: all eigenpairs, then the rows flipped (a copy)
        values, vectors = torch.linalg.eigh(moment)
        rows = vectors.T.flip(0)[:projected_rank].contiguous()
        del values, vectors, rows
    else:
        m = SecondMoment(dim)
        m.tokens, m.sum = dim + 1, moment  # a pilot wider than the taps: the moment path
        del moment
        fit_basis(m, projected_rank)
    seconds = time.perf_counter() - start
    return {"dim": dim, "method": method, "rank": projected_rank, "moment_bytes": dim * dim * 8,
            "peak_above_moment_bytes": _status("VmHWM") - held, "seconds": round(seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", default="3200,6400,12800", help="Widths D = n_taps x hidden_size (default 3200,6400,12800).")
    p.add_argument("--methods", default="before,after", help="before, after or both (default both).")
    p.add_argument("--rank-fraction", type=float, default=0.25, help="R as a fraction of D (default 0.25).")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1], int(args.child[2]))))
        return
    methods = args.methods.split(",")
    if set(methods) - {"before", "after"}:
        p.error(f"--methods takes before and after, got {args.methods!r}")
    if not 0 < args.rank_fraction < 1:
        p.error(f"--rank-fraction must be in (0, 1), got {args.rank_fraction}")
    rows = []
    for dim in positive_ints(p, "--dims", args.dims):
        for method in methods:
            projected_rank = max(1, int(dim * args.rank_fraction))
            done = subprocess.run([sys.executable, __file__, "--child", str(dim), method, str(projected_rank)], cwd=REPO,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                rows.append({"dim": dim, "method": method, "rank": projected_rank, "error": done.stderr.strip().splitlines()[-1:]})
            else:
                rows.append(json.loads(done.stdout))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "fit_memory", "rank_fraction": args.rank_fraction, "rows": rows}, indent=2))
    print()
    print("| D | R | method | moment | peak above the moment | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['dim']} | {r['rank']} | {r['method']} | | failed: {r['error']} | |")
        else:
            print(f"| {r['dim']} | {r['rank']} | {r['method']} | {r['moment_bytes'] / 1e9:.2f} GB | "
                  f"{r['peak_above_moment_bytes'] / 1e9:.2f} GB | {r['seconds']} |")


if __name__ == "__main__":
    main()
