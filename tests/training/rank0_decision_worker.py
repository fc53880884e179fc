"""Run by tests/training/test_draft_vocab.py under torchrun (gloo): pipeline.distributed.decided_on_rank0
with a decision that succeeds, one that refuses (PipelineError) and one that fails (a bug), in turn.
Writes OUT/rank<R>.json: per case, what this rank got and how often it ran the decision."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.distributed import decided_on_rank0  # noqa: E402
from pipeline.errors import PipelineError  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ran = []

    def succeeds():
        ran.append("succeeds")
        return {"ids": [3, 5, 8], "from_rank": rank}

    def refuses():
        ran.append("refuses")
        raise PipelineError("--draft-vocab 8: smaller than the 9 tokens a vocabulary keeps")

    def fails():
        ran.append("fails")
        return 1 // 0

    report = {}
    for case in (succeeds, refuses, fails):
        try:
            got = {"result": decided_on_rank0(case, rank=rank, world=world, what="testing")}
        except PipelineError as e:
            got = {"PipelineError": str(e)}
        except ZeroDivisionError as e:
            got = {"ZeroDivisionError": str(e)}
        report[case.__name__] = {**got, "ran": ran.count(case.__name__)}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
