"""One DFlash drafter training step (forward + backward) side by side on the CPU: ours against
vllm-project/speculators 0.9.x and sgl-project SpecForge 0.2.x, on the same batch, weights and
anchors.

    PEERS_PY benchmarks/peers_step.py [--config small|h1024] [--rounds 3] [--layers N]
                                      [--peers speculators,specforge|none] [--profile] [--json]

(default: h1024, 3 rounds, about 5 minutes on 2 cores; `--config small` about 30 s)

PEERS_PY is a python that can import torch, this repository's `pipeline` (put on sys.path here,
nothing to install) and the peers, which are installed without their serving dependencies:

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

What is measured. One drafter geometry (`--config`): `small` (hidden 128, 2 layers, 4 query / 2
KV heads of 32, intermediate 384, vocabulary 2,048, 5 taps, 512 tokens x 64 anchors x block 16)
or `h1024` (hidden 1024, `--layers` layers (default 1), 8 query / 2 KV heads of 128,
intermediate 3072, vocabulary 32,000, 5 taps, 2,048 tokens x 512 anchors x block 16, one
sequence). Random weights are built for our `DFlashDrafter` (norm gains randomised too) and
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
implementation in an order that alternates between rounds; the median seconds per step and our
speed over each peer's (also on this process's CPU time, steadier on a shared machine, where
OpenMP's spinning threads still inflate it). `--profile` adds a breakdown of our step (forward
modules, the loss (whose gradient may be taken in its forward), backward, kernel time and page
faults) and the top operators by self CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from pipeline.drafter.batch import SequenceBlocks, final_hidden, pack  # noqa: E402
from pipeline.drafter.blocks import block_targets, block_tokens  # noqa: E402
from pipeline.drafter.loss import LOSS_PATH, supervised_loss  # noqa: E402
from pipeline.drafter.model import DFlashDrafter, DrafterConfig  # noqa: E402


@dataclass
class Geometry:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    taps: int
    tokens: int
    anchors: int
    block: int = 16
    gamma: float = 7.0
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6


CONFIGS = {
    "small": Geometry(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=2048, taps=5,
                      tokens=512, anchors=64),
    "h1024": Geometry(hidden=1024, layers=1, heads=8, kv_heads=2, head_dim=128, intermediate=3072, vocab=32000, taps=5,
                      tokens=2048, anchors=512),
}


# ---------------------------------------------------------------------------------------------
# Shared weights and batch


def build_ours(g: Geometry, seed: int) -> DFlashDrafter:
    torch.manual_seed(seed)
    embed = nn.Embedding(g.vocab, g.hidden)
    nn.init.normal_(embed.weight, std=1.0)
    head = nn.Linear(g.hidden, g.vocab, bias=False)
    nn.init.normal_(head.weight, std=1.0 / math.sqrt(g.hidden))
    taps = [1 + 2 * i for i in range(g.taps)]
    config = DrafterConfig(hidden_size=g.hidden, intermediate_size=g.intermediate, num_hidden_layers=g.layers,
                           num_attention_heads=g.heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim,
                           vocab_size=g.vocab, target_layer_ids=taps, num_target_layers=taps[-1] + 2,
                           mask_token_id=g.vocab - 1, block_size=g.block, rms_norm_eps=g.eps, rope_theta=g.rope_theta)
    drafter = DFlashDrafter(config, embed=embed, lm_head=head)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm gains: not all ones, so a wrong mapping shows
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return drafter


@dataclass
class Batch:
    hidden_TNH: torch.Tensor       # [T, n, H] tapped hidden states
    last_hidden_TH: torch.Tensor   # [T, H] the target's last hidden state (speculators' label source)
    input_ids: torch.Tensor        # [T]
    target_argmax: torch.Tensor    # [T]
    loss_mask: torch.Tensor        # [T] long
    anchors: torch.Tensor          # [A] sorted


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def build_batch(g: Geometry, head_weight: torch.Tensor, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    t = g.tokens
    hidden = torch.randn(t, g.taps, g.hidden, generator=gen)
    last = torch.randn(t, g.hidden, generator=gen)
    with torch.no_grad():  # the target's prediction at t: argmax of its lm_head on its normed last state
        argmax = torch.cat([(rms(last[i:i + 256], g.eps) @ head_weight.t()).argmax(-1) for i in range(0, t, 256)])
    input_ids = torch.empty(t, dtype=torch.long)
    input_ids[0] = int(torch.randint(g.vocab - 1, (1,), generator=gen))
    input_ids[1:] = argmax[:-1]  # teacher-forced text: the next token is the target's prediction
    loss_mask = torch.ones(t, dtype=torch.long)
    prompt = t // 8
    loss_mask[:prompt] = 0
    # Valid for all three: loss_mask[a] = loss_mask[a+1] = 1 (ours, SpecForge) and a < T - B
    # (speculators keeps the last block's positions out).
    candidates = torch.arange(prompt, t - g.block)
    anchors = candidates[torch.randperm(len(candidates), generator=gen)[:g.anchors]].sort().values
    return Batch(hidden, last, input_ids, argmax, loss_mask, anchors)


# ---------------------------------------------------------------------------------------------
# The three steps. Each `step()` runs forward + backward from zero grads and returns the loss
# normalised as sum(ce*w)/sum(w) (a float); `grads()` gives the gradients under our names, on
# that same normalisation.


class Ours:
    name = "ours"
    attention = f"split_block_attention (no dense mask); loss: {LOSS_PATH}"

    def __init__(self, drafter: DFlashDrafter, b: Batch, g: Geometry):
        self.model = drafter
        labels, weights = block_targets(b.target_argmax, b.loss_mask, b.anchors, g.block, g.gamma)
        ids, pos = block_tokens(b.input_ids, b.anchors, g.block, g.vocab - 1)
        self.packed = pack([SequenceBlocks(b.hidden_TNH, ids, pos, b.anchors, labels, weights)], g.block)
        self.total_w = float(weights.sum())

    def params(self):
        return dict(self.model.named_parameters())

    def forward(self):
        final = final_hidden(self.model, self.packed)
        loss_sum, _ = supervised_loss(final, self.model.lm_head_weight, self.packed.labels, self.packed.weights)
        return loss_sum / self.total_w

    def step(self) -> float:
        self.model.zero_grad(set_to_none=True)
        loss = self.forward()
        loss.backward()
        return float(loss.detach())

    def grads(self):
        return {k: p.grad for k, p in self.params().items()}


def qwen3_config(g: Geometry, attn: str):
    from transformers import Qwen3Config
    config = Qwen3Config(hidden_size=g.hidden, intermediate_size=g.intermediate, num_hidden_layers=g.layers,
                         num_attention_heads=g.heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim,
                         vocab_size=g.vocab, rms_norm_eps=g.eps, max_position_embeddings=max(4096, 2 * g.tokens),
                         rope_parameters={"rope_type": "default", "rope_theta": g.rope_theta}, attention_bias=False,
                         hidden_act="silu", layer_types=["full_attention"] * g.layers, tie_word_embeddings=False)
    config._attn_implementation = attn
    return config


def copy_shared(ours: DFlashDrafter, peer: nn.Module, prefix: str = "") -> list[str]:
    """Copy our trainable weights into the peer's parameters of the same names; every trainable
    peer parameter must be covered. Returns the names."""
    peer_params = dict(peer.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            q = peer_params.get(prefix + name)
            if q is None or q.shape != p.shape:
                raise SystemExit(f"{type(peer).__name__}: no parameter {prefix + name} of shape {tuple(p.shape)}")
            q.copy_(p)
    ours_names = {prefix + n for n, _ in ours.named_parameters()}
    extra = [n for n, q in peer_params.items() if q.requires_grad and n not in ours_names]
    if extra:
        raise SystemExit(f"{type(peer).__name__}: trainable parameters with no counterpart: {extra}")
    return [n for n, _ in ours.named_parameters()]


class Speculators:
    name = "speculators"

    def __init__(self, ours: DFlashDrafter, b: Batch, g: Geometry):
        import speculators
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.losses import resolve_loss_config
        from speculators.models.dflash import core
        from speculators.models.dflash.config import DFlashSpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig

        self.version = speculators.__version__ if hasattr(speculators, "__version__") else _dist_version("speculators")
        self.attention = "SDPA with the dense boolean [Q, T+Q] mask (create_mask); eager CE on full [Q, V] logits"
        config = DFlashSpeculatorConfig(
            transformer_layer_config=qwen3_config(g, "sdpa"), draft_vocab_size=g.vocab, block_size=g.block,
            aux_hidden_state_layer_ids=list(ours.config.target_layer_ids), mask_token_id=g.vocab - 1,
            speculators_config=SpeculatorsConfig(
                algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=g.block - 1)],
                default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])))
        model = core.DFlashDraftModel(config)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(ours._frozen["embed"].weight)
            model.lm_head.weight.copy_(ours.lm_head_weight)
            model.verifier_lm_head.weight.copy_(ours.lm_head_weight)
            model.verifier_norm.weight.fill_(1.0)
        self.shared = copy_shared(ours, model)
        model.train()
        self.model = model
        # Their anchor sampler (torch.randperm) replaced by ours; every anchor is valid.
        anchors = b.anchors.clone()
        core.select_anchors = lambda loss_mask, num, block: (anchors.clone(), torch.ones(num, dtype=torch.bool))
        t = g.tokens
        self.kwargs = dict(
            hidden_states=b.hidden_TNH.reshape(1, t, -1), input_ids=b.input_ids[None], loss_mask=b.loss_mask[None],
            verifier_last_hidden_states=b.last_hidden_TH[None], document_ids=torch.zeros(1, t, dtype=torch.long),
            loss_config=resolve_loss_config("ce", "eager"), gamma=g.gamma, max_anchors=g.anchors,
            per_position_loss_weight="fixed-exp-decay")
        # Their loss is sum(ce*w) / (supervised count + 1e-5); ours sum(ce*w) / sum(w).
        labels, weights = block_targets(b.target_argmax, b.loss_mask, b.anchors, g.block, g.gamma)
        count = float((weights > 0).sum())
        self.scale = (count + 1e-5) / float(weights.sum())

    def step(self) -> float:
        self.model.zero_grad(set_to_none=True)
        _, loss, _ = self.model(**self.kwargs)
        loss.backward()
        return float(loss.detach()) * self.scale

    def grads(self):
        params = dict(self.model.named_parameters())
        return {k: params[k].grad * self.scale for k in self.shared}


class SpecForge:
    name = "specforge"

    def __init__(self, ours: DFlashDrafter, b: Batch, g: Geometry):
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.draft.dflash import DFlashDraftModel

        self.version = _dist_version("specforge")
        self.attention = ("SDPA with the dense boolean [Q, T+Q] mask (create_dflash_sdpa_mask); "
                          "lm_head + CE in checkpointed chunks of 128 blocks")
        config = qwen3_config(g, "sdpa")
        config.block_size = g.block
        config.num_target_layers = ours.config.num_target_layers
        config.dflash_config = {"target_layer_ids": list(ours.config.target_layer_ids), "mask_token_id": g.vocab - 1}
        draft = DFlashDraftModel(config)
        self.shared = copy_shared(ours, draft)
        draft.train()
        # The target's frozen modules: the same tensors as ours.
        self.model = OnlineDFlashModel(
            draft_model=draft, target_lm_head=ours._frozen["lm_head"], target_embed_tokens=ours._frozen["embed"],
            mask_token_id=g.vocab - 1, block_size=g.block, attention_backend="sdpa",
            num_anchors=g.anchors, loss_decay_gamma=g.gamma, loss_type="dflash")
        anchors = b.anchors[None].clone()
        self.model._sample_anchor_positions = lambda seq_len, loss_mask, device: (
            anchors.clone(), torch.ones_like(anchors, dtype=torch.bool))
        t = g.tokens
        self.args = (b.input_ids[None], b.hidden_TNH.reshape(1, t, -1), b.loss_mask[None].float())

    def step(self) -> float:
        self.model.draft_model.zero_grad(set_to_none=True)
        loss, _, _ = self.model(*self.args)
        loss.backward()
        return float(loss.detach())

    def grads(self):
        params = dict(self.model.draft_model.named_parameters())
        return {k: params[k].grad for k in self.shared}


def _load() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def _dist_version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


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


def timed_both(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds, user + system): the CPU time is the steadier
    number on a machine shared with other work."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


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
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds, each one step of every implementation (default %(default)s)")
    parser.add_argument("--peers", default="speculators,specforge", help="comma-separated subset, or 'none'")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights; the batch uses seed + 1 (default %(default)s)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
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
    g = CONFIGS[args.config]
    if args.layers:
        g.layers = args.layers

    ours_model = build_ours(g, args.seed)
    batch = build_batch(g, ours_model.lm_head_weight.detach(), args.seed + 1)
    impls = [Ours(ours_model, batch, g)]
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

    times = {impl.name: [] for impl in impls}
    cpu = {impl.name: [] for impl in impls}
    for r in range(args.rounds):
        order = impls if r % 2 == 0 else impls[::-1]
        for impl in order:
            wall, used = timed_both(impl.step)
            times[impl.name].append(wall)
            cpu[impl.name].append(used)
            impl.model.zero_grad(set_to_none=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}

    result = {
        "config": args.config, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "geometry": vars(g), "queries": g.anchors * g.block, "rounds": args.rounds,
        "ours_loss": ours_loss,
        "paths": {impl.name: impl.attention for impl in impls},
        "versions": {impl.name: impl.version for impl in impls[1:]},
        "checks": checks,
        "seconds_per_step": {k: round(v, 3) for k, v in med.items()},
        "min_seconds_per_step": {k: round(min(v), 3) for k, v in times.items()},
        "all_seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "ours_speedup": {k: round(v / med["ours"], 2) for k, v in med.items() if k != "ours"},
        "ours_speedup_min": {k: round(min(v) / min(times["ours"]), 2) for k, v in times.items() if k != "ours"},
        "cpu_seconds_per_step": {k: round(v, 3) for k, v in med_cpu.items()},
        "ours_speedup_cpu": {k: round(v / med_cpu["ours"], 2) for k, v in med_cpu.items() if k != "ours"},
        "load_average_1min": round(_load(), 2),
    }
    if args.profile:
        prof = profile_ours(impls[0])
        table = prof.pop("_table")
        result["ours_profile"] = prof
        if not args.json:
            print(table)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for k, v in result.items():
        print(f"{k}: {json.dumps(v) if isinstance(v, (dict, list)) else v}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
