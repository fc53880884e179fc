"""Run by tests/training/test_zero_gather.py under torchrun (gloo): the optimizer state gathered for a
checkpoint (pipeline.training.plan.gathered_state) against torch's own consolidation of the same
ZeroRedundancyOptimizer (consolidate_state_dict, then state_dict()) on rank 0. Writes OUT/result.json."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.training.plan import gathered_state  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same parameters on every rank
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Linear(40, 7, bias=False), torch.nn.Linear(7, 3))
    params = list(model.parameters())
    optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=0.01, betas=(0.9, 0.95),
                                        weight_decay=0.1)
    report = {}
    for step in range(3):
        if step:  # step 0: no state yet
            g = torch.Generator().manual_seed(100 * step + rank)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            optimizer.step()
            for group in optimizer.param_groups:
                group["lr"] = 0.01 / (step + 1)  # as the trainer's schedule sets it
        mine = gathered_state(optimizer, rank, world, torch.device("cpu"))
        optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            reference = optimizer.state_dict()
            same_groups = mine["param_groups"] == reference["param_groups"]
            same_keys = sorted(mine["state"]) == sorted(reference["state"])
            same_tensors = same_keys and all(
                sorted(mine["state"][i]) == sorted(reference["state"][i])
                and all(torch.equal(mine["state"][i][k].float(), torch.as_tensor(reference["state"][i][k]).float())
                        for k in reference["state"][i])
                for i in reference["state"])
            report[step] = {"groups": same_groups, "keys": same_keys, "tensors": same_tensors,
                            "params_with_state": len(reference["state"])}
        else:
            report[step] = {"none_off_rank_0": mine is None}
    owned = [None] * world  # how many parameters' state each rank holds: the gather must cross ranks
    dist.all_gather_object(owned, sum(len(g["params"]) for g in optimizer.optim.param_groups))
    report["owned"] = owned
    if rank == 0:
        (out / "result.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
