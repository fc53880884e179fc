"""One DFlash drafter training step (forward + backward) side by side on the CPU: ours against
vllm-project/speculators 0.9.x and sgl-project SpecForge 0.2.x, on the same batch, weights and
anchors.

    PEERS_PY benchmarks/training/peers_step.py [--config small|h512|h1024|w5120] [--rounds 3] [--layers N]
                                      [--peers speculators,specforge|none] [--before REV]
                                      [--set FIELD=N ...] [--floor] [--trainer-allocator]
                                      [--profile] [--json]

(default: h1024, 3 rounds, about 5 minutes on 2 cores; `--config small` about 30 s)

PEERS_PY is a python that can import torch, this repository's `pipeline` (put on sys.path by
peers_impls.py, nothing to install) and the peers, which are installed without their serving dependencies:

    python3 -m venv peers-venv
    peers-venv/bin/pip install torch==2.13.0
    peers-venv/bin/pip install --no-deps speculators==0.9.0 specforge==0.2.0 hs-connectors==0.9.0
    peers-venv/bin/pip install transformers==5.19.0 numpy pydantic pydantic-settings safetensors loguru \
        dill xxhash fsspec requests python-dateutil
    peers-venv/bin/pip install --no-deps openai sniffio "datasets<=5.1.0" multiprocess pandas pyarrow

(speculators' package __init__ imports its trainer's data module, hence openai/datasets/pandas;
transformers 5.19 is the newest speculators allows; what this imports of ours, the drafter and
its loss, is plain torch; SpecForge pins 5.8.1 and torch 2.11, and its DFlash modules import and
run under these as well.)

What is measured. One drafter geometry (`--config`, all block 16, 5 taps, one sequence;
`--layers` overrides the layer count): `small` (hidden 128, 2 layers, 4 query / 2 KV heads of
32, intermediate 384, vocabulary 2,048, 512 tokens x 64 anchors), `h512` (hidden 512, 1 layer,
8 / 2 heads of 64, intermediate 1536, vocabulary 32,000, 2,048 tokens x 256 anchors), `h1024`
(hidden 1024, 1 layer, 8 / 2 heads of 128, intermediate 3072, vocabulary 32,000, 2,048 tokens x
512 anchors) or `w5120` (the flagship drafter's width: hidden 5120, 32 / 8 heads of 128,
intermediate 17408; reduced counts: 1 layer, vocabulary 32,000, 1,024 tokens x 64 anchors). Random weights are built for our `DFlashDrafter` (norm gains randomised too) and
copied, parameter by parameter under the same names, into speculators' `DFlashDraftModel` and
SpecForge's `DFlashDraftModel`; the frozen embedding and lm_head are the same tensors for all.
The batch: random tapped hidden states, a random last hidden state of the target whose
lm_head argmax is the target's prediction, input_ids[t+1] = that prediction at t (so
SpecForge's labels, the next input token, are speculators' and ours, the target's argmax), a
loss mask with a zero prompt prefix, and one sorted set of anchors valid for all three (each
peer's own random anchor sampler is replaced by a function returning these). Loss: hard-label
cross-entropy with decay weights exp(-(k-1)/gamma), gamma 7, slot 0 unsupervised.

Each implementation's step is its training forward as shipped (mask building, target labels,
loss) plus `loss.backward()`, fp32:
- ours: the trainer's path, `final_hidden` (split block attention, no dense mask) +
  `supervised_loss` (chunked lm_head + CE on the supervised slots only), divided by sum(w);
- speculators: `DFlashDraftModel.forward` with attention `sdpa` and the dense boolean mask its
  `create_mask` builds ([Q, T+Q]), the eager `ce` loss (`--loss-implementation eager`: the fused
  one is Triton-only) over full [Q, V] logits, and its targets = argmax of the verifier lm_head
  on the verifier's last hidden states (computed inside its forward, no grad); its loss is
  sum(ce*w) / (count of supervised slots + 1e-5), rescaled here to sum(ce*w) / sum(w) for the
  comparison (gradients likewise, by the same constant);
- SpecForge: `OnlineDFlashModel` with attention backend `sdpa` (dense boolean [Q, T+Q] mask)
  and its chunked (128 blocks, checkpointed) lm_head + CE objective, normalised by sum(w).
Both peers default to flex attention, which has no backward on the CPU (torch 2.13 raises
"FlexAttention does not support backward on CPU"), hence their SDPA paths.

First one step of each from zero gradients: the losses (relative difference to ours) and, on
every trainable parameter, the gradient difference (max abs, and max abs over the parameter's
max |grad|, worst parameter). Then `--rounds` rounds, each timing one step of every
implementation in an order that alternates between rounds. Every step is listed with its wall
and CPU seconds and the other processes' share of the machine's CPUs meanwhile (from /proc/stat:
a loaded machine shows). Each peer's time over ours is given round by round (wall, and this
process's CPU time, steadier on a shared machine where OpenMP's spinning threads still inflate
it); the headline ratio (the median) is printed only when the rounds agree within 25%, else the
output says the rounds disagree and prints no ratio. `--before REV` adds ours with
`split_block_attention` taken from git revision REV (its gradients checked against ours too), so
an attention change is measured before and after in the same run. `--floor` adds the step's
unavoidable matrix multiplies alone (`GemmFloor`, a lower bound on any implementation's step)
to the rounds and each implementation's time over it. `--trainer-allocator` runs the whole
process with `pipeline train`'s allocator setting (freed large buffers stay mapped, so a step
does not page-fault its activations and gradients in afresh); every implementation gets it.
`--profile` adds a breakdown of our step (forward
modules, the loss (whose gradient may be taken in its forward), backward, kernel time and page
faults) and the top operators by self CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from peers_impls import CONFIGS, GemmFloor, Ours, OursAt, SpecForge, Speculators, build_batch, build_ours  # puts the repo on sys.path
from pipeline.allocator import keep_freed_buffers_mapped
from pipeline.training.batch import final_hidden
from pipeline.training.loss import supervised_loss

# Round ratios further apart than this (largest over smallest) print no headline ratio: the
# machine was not steady enough for one number (issue 32).
MAX_ROUND_SPREAD = 1.25


def _load() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: user, nice, system,
    irq, softirq, steal); NaN where there is no /proc."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------


def compare(ours_loss: float, ours_grads: dict, loss: float, grads: dict) -> dict:
    worst_abs, worst_rel, worst_name = 0.0, 0.0, None
    num, den = 0.0, 0.0
    for name, g in ours_grads.items():
        d = (grads[name] - g).abs()
        rel = float(d.max()) / max(float(g.abs().max()), 1e-30)
        worst_abs = max(worst_abs, float(d.max()))
        if rel > worst_rel:
            worst_rel, worst_name = rel, name
        num += float(d.double().pow(2).sum())
        den += float(g.double().pow(2).sum())
    return {"loss": loss, "loss_rel_diff": abs(loss - ours_loss) / abs(ours_loss),
            "grad_max_abs_diff": worst_abs, "grad_max_rel_diff": worst_rel, "grad_worst_param": worst_name,
            "grad_rel_l2_diff": math.sqrt(num / den)}


def timed(fn) -> tuple[float, float, float]:
    """(wall seconds, this process's CPU seconds (user + system), the other processes' share of
    the machine's CPUs meanwhile). The CPU time is the steadier number on a shared machine; the
    share shows when it was shared: 0.0 on an idle machine, 0.5 when others kept half the cores
    busy."""
    busy, wall, cpu = _busy_cpu_seconds(), time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    others = max(0.0, _busy_cpu_seconds() - busy - cpu) / (wall * (os.cpu_count() or 1))
    return wall, cpu, others


def per_round(times: dict[str, list[float]], base: str) -> dict:
    """Each implementation's time over `base`'s, round by round (the same round's steps ran
    back to back), their median, and whether the rounds agree enough for a headline ratio."""
    out = {}
    for name, values in times.items():
        if name == base:
            continue
        ratios = [v / b for v, b in zip(values, times[base])]
        spread = max(ratios) / min(ratios)
        out[name] = {"rounds": [round(r, 2) for r in ratios], "median": round(statistics.median(ratios), 2),
                     "spread": round(spread, 2), "headline": spread <= MAX_ROUND_SPREAD}
    return out


def floor_bounds(floor: GemmFloor, times: dict[str, list[float]]) -> dict:
    """Each implementation's time over the floor's, round by round: for a peer, the most that any
    implementation of the same objective could lead it by on this machine."""
    over = per_round(times, floor.name)
    return {"floor_gflop": round(floor.flops / 1e9, 1),
            "floor_gflops_per_second": round(floor.flops / 1e9 / statistics.median(times[floor.name]), 1),
            "over_floor": {k: {"rounds": v["rounds"], "median": v["median"]} for k, v in over.items()}}


def profile_ours(impl: Ours, rows: int = 15) -> dict:
    """Where our step's time goes: forward pieces timed with forward hooks, the loss, backward,
    and the top operators (self CPU time) of one profiled step."""
    model = impl.model
    spans: dict[str, float] = {}
    starts: dict[str, float] = {}

    def hook_pair(key):
        def pre(_m, _a):
            starts[key] = time.perf_counter()

        def post(_m, _a, _o):
            spans[key] = spans.get(key, 0.0) + time.perf_counter() - starts[key]
        return pre, post

    handles = []
    watched = {name: m for name, m in model.named_modules()
               if name and (isinstance(m, (nn.Linear, nn.RMSNorm)) or name.endswith("self_attn"))}
    for key, module in watched.items():
        pre, post = hook_pair(key)
        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    final = final_hidden(model, impl.packed)
    t1 = time.perf_counter()
    loss_sum, _ = supervised_loss(final, model.lm_head_weight, impl.packed.labels, impl.packed.weights)
    loss = loss_sum / impl.total_w
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    for h in handles:
        h.remove()
    phases = {"forward_drafter_s": t1 - t0, "forward_loss_s": t2 - t1, "backward_s": t3 - t2, "step_s": t3 - t0,
              "forward_modules_s": {k: round(v, 4) for k, v in spans.items()}}
    for name in [n for n in spans if n.endswith("self_attn")]:
        inner = sum(v for k, v in spans.items() if k.startswith(name + ".") and isinstance(watched[k], nn.Linear))
        phases[f"{name}.core_forward_s"] = round(spans[name] - inner, 4)  # norms, rope, the attention itself
    # Backward split: the loss's backward alone (grad of the final states), then the rest.
    model.zero_grad(set_to_none=True)
    final = final_hidden(model, impl.packed)
    leaf = final.detach().requires_grad_(True)
    loss_sum, _ = supervised_loss(leaf, model.lm_head_weight, impl.packed.labels, impl.packed.weights)
    t0 = time.perf_counter()
    (loss_sum / impl.total_w).backward()
    t1 = time.perf_counter()
    final.backward(leaf.grad)
    t2 = time.perf_counter()
    phases["backward_loss_s"], phases["backward_drafter_s"] = t1 - t0, t2 - t1
    # Kernel time: fresh pages of large temporaries (glibc hands each one back to the system when
    # it is freed, so every step faults them in again).
    model.zero_grad(set_to_none=True)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    impl.step()
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    phases["step_wall_s"] = t1 - t0
    phases["step_user_cpu_s"] = r1.ru_utime - r0.ru_utime
    phases["step_sys_cpu_s"] = r1.ru_stime - r0.ru_stime
    phases["step_minor_page_faults"] = r1.ru_minflt - r0.ru_minflt
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        impl.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    top = [{"op": e.key, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 3), "calls": e.count}
           for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]]
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in phases.items()} | {"top_ops": top,
                                                                                          "_table": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="h1024",
                        help="drafter geometry: small (hidden 128, about 30 s) or h1024 (hidden 1024, about 5 min) (default %(default)s)")
    parser.add_argument("--layers", type=int, help="drafter layers (default: the config's)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=N",
                        help="override one geometry field, e.g. --set vocab=2048 --set anchors=128 (repeatable)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds, each one step of every implementation (default %(default)s)")
    parser.add_argument("--peers", default="speculators,specforge", help="comma-separated subset, or 'none'")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights; the batch uses seed + 1 (default %(default)s)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--before", metavar="REV",
                        help="also time ours with split_block_attention as it was at git revision REV (before/after in one run)")
    parser.add_argument("--floor", action="store_true",
                        help="also time the step's unavoidable matrix multiplies alone (GemmFloor): the most any "
                             "implementation could lead each peer by")
    parser.add_argument("--trainer-allocator", action="store_true",
                        help="give this process the allocator setting `pipeline train` runs with (glibc keeps freed "
                             "buffers instead of unmapping them: keep_freed_buffers_mapped); it applies to every "
                             "implementation timed here")
    parser.add_argument("--profile", action="store_true", help="also break our step down (a few extra steps)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not as key: value lines")
    args = parser.parse_args()
    # Bad values end here in one line, not in a traceback after the weights are built.
    for name in ("layers", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    known = {"speculators", "specforge"}
    peers = [] if args.peers == "none" else [p.strip() for p in args.peers.split(",") if p.strip()]
    if not set(peers) <= known:
        parser.error(f"--peers: unknown {sorted(set(peers) - known)}; choose from {sorted(known)} or 'none'")
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = "default"
    if args.trainer_allocator:
        if not keep_freed_buffers_mapped():
            parser.error("--trainer-allocator: not applied (not glibc, or MALLOC_MMAP_THRESHOLD_ is set)")
        allocator = "trainer's: glibc keeps freed buffers (M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD 2 GiB)"
    g = CONFIGS[args.config]
    if args.layers:
        g.layers = args.layers
    for item in args.set:
        field, _, value = item.partition("=")
        if field not in vars(g) or not value.lstrip("-").replace(".", "", 1).isdigit():
            parser.error(f"--set {item!r}: expected FIELD=NUMBER with FIELD one of {', '.join(vars(g))}")
        number = float(value)
        setattr(g, field, int(number) if isinstance(getattr(g, field), int) else number)

    ours_model = build_ours(g, args.seed)
    batch = build_batch(g, ours_model.lm_head_weight.detach(), args.seed + 1)
    impls = [Ours(ours_model, batch, g)]
    if args.before:
        impls.append(OursAt(ours_model, batch, g, args.before))
    for p in peers:
        cls = {"speculators": Speculators, "specforge": SpecForge}[p]
        impls.append(cls(ours_model, batch, g))

    # Correctness (also the warm-up): one step each from zero grads, same weights.
    ours_loss = impls[0].step()
    ours_grads = {k: v.clone() for k, v in impls[0].grads().items()}
    impls[0].model.zero_grad(set_to_none=True)
    checks = {}
    for impl in impls[1:]:
        loss = impl.step()
        checks[impl.name] = compare(ours_loss, ours_grads, loss, impl.grads())
        impl.model.zero_grad(set_to_none=True)
    del ours_grads
    if args.floor:  # timed in the rounds like the others; no loss or gradients to check
        impls.append(GemmFloor(g))

    times = {impl.name: [] for impl in impls}
    cpu = {impl.name: [] for impl in impls}
    rounds = []
    for r in range(args.rounds):
        order = impls if r % 2 == 0 else impls[::-1]
        for impl in order:
            wall, used, others = timed(impl.step)
            times[impl.name].append(wall)
            cpu[impl.name].append(used)
            rounds.append({"round": r + 1, "impl": impl.name, "seconds": round(wall, 3), "cpu_seconds": round(used, 3),
                           "others_cpu_share": round(others, 2)})
            impl.model.zero_grad(set_to_none=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    steps_only = {k: v for k, v in times.items() if k != GemmFloor.name}  # the floor is no implementation
    ratios = per_round(steps_only, "ours")
    ratios_cpu = per_round({k: v for k, v in cpu.items() if k != GemmFloor.name}, "ours")

    result = {
        "config": args.config, "threads": torch.get_num_threads(), "torch": torch.__version__, "allocator": allocator,
        "geometry": vars(g), "queries": g.anchors * g.block, "rounds": args.rounds,
        "ours_loss": ours_loss,
        "paths": {impl.name: impl.attention for impl in impls},
        "versions": {impl.name: impl.version for impl in impls[1:]},
        "checks": checks,
        "steps": rounds,
        "seconds_per_step": {k: round(v, 3) for k, v in med.items()},
        "cpu_seconds_per_step": {k: round(v, 3) for k, v in med_cpu.items()},
        # Their step time over ours, round by round (wall, then CPU time); a headline only where
        # the rounds agree within MAX_ROUND_SPREAD.
        "ours_speedup_rounds": ratios,
        "ours_speedup_cpu_rounds": ratios_cpu,
        "ours_speedup": {k: (v["median"] if v["headline"] else None) for k, v in ratios.items()},
        "ours_speedup_cpu": {k: (v["median"] if v["headline"] else None) for k, v in ratios_cpu.items()},
        **(floor_bounds(impls[-1], times) if args.floor else {}),
        "others_cpu_share_max": max(x["others_cpu_share"] for x in rounds),
        "load_average_1min": round(_load(), 2),
    }
    if args.profile:  # ours, and ours at --before
        for impl in [i for i in impls if isinstance(i, Ours)]:
            with impl.active():
                prof = profile_ours(impl)
            table = prof.pop("_table")
            result[f"{impl.name}_profile"] = prof
            if not args.json:
                print(f"{impl.name}:\n{table}")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for k, v in result.items():
        if k != "steps":
            print(f"{k}: {json.dumps(v) if isinstance(v, (dict, list)) else v}")
    print(f"\n{'round':>5}  {'implementation':<24} {'seconds':>8} {'cpu s':>8}  others' CPU share")
    for x in rounds:
        print(f"{x['round']:>5}  {x['impl']:<24} {x['seconds']:>8.3f} {x['cpu_seconds']:>8.3f}  {x['others_cpu_share']:.2f}")
    for name, v in ratios.items():
        rounds_text = ", ".join(f"{r:.2f}" for r in v["rounds"])
        verdict = (f"ours {v['median']:.2f}x faster than {name}" if v["headline"] else
                   f"no headline ratio against {name}: rounds disagree by {v['spread']:.2f}x (> {MAX_ROUND_SPREAD}); "
                   "rerun on an idle machine")
        print(f"{verdict} (rounds {rounds_text})")
    for name, v in result.get("over_floor", {}).items():
        print(f"{name}: {v['median']:.2f}x the matrix-multiply floor (rounds {', '.join(f'{r:.2f}' for r in v['rounds'])})"
              + ("" if name.startswith("ours") else f": no implementation can lead {name} by more"))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
