"""The mutation audit behind issue 81, replayable: each planted bug of the audit, planted into a
copy of a commit, and the tests meant to cover it run there (BENCHMARKS.md, "The audit's mutants,
before and after": before is 9d1cf84, after 1be7e4c).

    python benchmarks/mutation/audit.py [--rev REV] [--only NAME ...] [--check] [--list]

Per mutant: the commit's files (`git archive`) in a fresh temporary folder, the one replacement
planted (its original text must occur exactly once there), then `python -m pytest -q` over the
mutant's test files that exist at that commit, with that copy first on PYTHONPATH so its
`pipeline` is the one imported. "killed" when pytest fails, "survived" when it passes. `--check`
only plants each mutant (both texts exist at the commit) without running tests. The runs take
minutes each (the sampling tests most); torch runs on one thread.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAINING = ("tests/training/test_blocks.py", "tests/training/test_loss.py", "tests/training/test_draft_vocab.py",
            "tests/training/test_objectives.py")


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    mutated: str
    tests: tuple[str, ...]
    select: str = ""            # pytest -k, where only some tests of a file are meant


MUTANTS = (
    Mutant("soft-target-late", "pipeline/training/blocks.py",
           "source = (anchors_A[:, None] + torch.arange(block_size)[None] - 1).clamp(0, t - 1)",
           "source = (anchors_A[:, None] + torch.arange(block_size)[None]).clamp(0, t - 1)", TRAINING),
    Mutant("hard-label-late", "pipeline/training/blocks.py",
           "labels = target_argmax_T[(safe - 1).clamp(min=0)].long()", "labels = target_argmax_T[safe].long()",
           TRAINING),
    Mutant("span-rule-inside", "pipeline/data/loss_mask.py",
           "mask |= (offsets[:, 0] < e) & (offsets[:, 1] > s)", "mask |= (offsets[:, 0] >= s) & (offsets[:, 1] <= e)",
           ("tests/data/test_loss_mask.py",)),
    Mutant("span-rule-starts-inside", "pipeline/data/loss_mask.py",
           "mask |= (offsets[:, 0] < e) & (offsets[:, 1] > s)", "mask |= (offsets[:, 0] >= s) & (offsets[:, 0] < e)",
           ("tests/data/test_loss_mask.py",)),
    Mutant("stream-shutdown-removed", "pipeline/training/stream.py",
           "        finally:\n            stop.set()\n            while thread.is_alive():\n                try:\n"
           "                    q.get_nowait()\n                except queue.Empty:\n"
           "                    thread.join(timeout=0.05)\n",
           "        finally:\n            pass\n", ("tests/training/test_stream.py",)),
    Mutant("streak8-from-top4", "pipeline/training/metrics.py",
           '"streak8": (_streak(top8) * real).sum().to(f),', '"streak8": (_streak(top4) * real).sum().to(f),',
           ("tests/training/test_loss.py", "tests/training/test_blocks.py")),
    Mutant("top8-as-top4", "pipeline/training/metrics.py",
           "hit[..., :4].any(-1), hit.any(-1)], dim=-1)", "hit[..., :4].any(-1), hit[..., :4].any(-1)], dim=-1)",
           ("tests/training/test_loss.py", "tests/training/test_blocks.py")),
    Mutant("rope-flipped", "pipeline/drafter/model.py",
           "return (x.float() * emb.cos() + rotate_half(x.float()) * emb.sin()).to(x.dtype)",
           "return (x.float() * emb.cos() - rotate_half(x.float()) * emb.sin()).to(x.dtype)",
           ("tests/drafter/test_reference_export.py", "tests/drafter/test_reference_decoding.py")),
    Mutant("residual-reuses-the-acceptance-number", "pipeline/eval/speculative_sampling.py",
           "self.u(row, position, RESIDUAL))", "self.u(row, position, ACCEPT))", ("tests/eval/test_sampling.py",)),
    Mutant("draft-judged-against-the-next-p", "pipeline/eval/speculative_sampling.py",
           "torch.stack([p[slots, x], q[slots, x]", "torch.stack([p[slots + 1, x], q[slots, x]",
           ("tests/eval/test_sampling.py",), select="block_speculative_sampling_is_lossless or one_block_slot"),
)


def checkout(rev: str, into: Path) -> None:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


def run(mutant: Mutant, copy: Path, check_only: bool) -> str:
    path = copy / mutant.file
    source = path.read_text()
    if source.count(mutant.original) != 1:
        return f"not planted: the original text occurs {source.count(mutant.original)} times in {mutant.file}"
    if check_only:
        return "plants"
    tests = [t for t in mutant.tests if (copy / t).exists()]
    path.write_text(source.replace(mutant.original, mutant.mutated))
    try:
        env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *tests,
                   *(["-k", mutant.select] if mutant.select else [])]
        result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)
    finally:
        path.write_text(source)
    lines = (result.stdout + result.stderr).strip().splitlines()
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in lines if line.startswith(("FAILED", "ERROR"))]
    verdict = "survived" if result.returncode == 0 else "killed"
    return f"{verdict}: {lines[-1] if lines else 'no output'}" + "".join(f"\n    {name}" for name in failed[:8])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD", help="the commit to plant into (default HEAD)")
    parser.add_argument("--only", nargs="+", default=None, help="these mutants by name")
    parser.add_argument("--check", action="store_true", help="plant each mutant, run nothing")
    parser.add_argument("--list", action="store_true", help="the mutants and their tests")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.only is None or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file}\n    - {m.original}\n    + {m.mutated}\n    tests: {' '.join(m.tests)}")
        return
    with tempfile.TemporaryDirectory(prefix="audit-") as tmp:
        copy = Path(tmp)
        checkout(args.rev, copy)
        for m in chosen:
            print(f"{m.name} ({args.rev}): {run(m, copy, args.check)}", flush=True)


if __name__ == "__main__":
    main()
