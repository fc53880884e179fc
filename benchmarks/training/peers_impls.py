"""The three implementations of one DFlash drafter training step that benchmarks/training/peers_step.py
times side by side (ours, speculators, SpecForge), their shared random weights and batch, and the
geometries. See peers_step.py's docstring for what each step runs and how the peers are
installed."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import pipeline.drafter.attention_rule as attention_rule  # noqa: E402
from pipeline.training.batch import SequenceBlocks, final_hidden, pack  # noqa: E402
from pipeline.training.blocks import block_targets, block_tokens  # noqa: E402
from pipeline.training.loss import LOSS_PATH, supervised_loss  # noqa: E402
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
    # Where the lead was gone in the independent re-measure (issue 32): hidden 512, 256 anchors.
    "h512": Geometry(hidden=512, layers=1, heads=8, kv_heads=2, head_dim=64, intermediate=1536, vocab=32000, taps=5,
                     tokens=2048, anchors=256),
    "h1024": Geometry(hidden=1024, layers=1, heads=8, kv_heads=2, head_dim=128, intermediate=3072, vocab=32000, taps=5,
                      tokens=2048, anchors=512),
    # The flagship drafter's width and heads (32 q / 8 kv x 128, intermediate 17408) with reduced
    # counts (one layer, vocabulary 32,000, 1,024 tokens x 64 anchors), so all three fit and run here.
    "w5120": Geometry(hidden=5120, layers=1, heads=32, kv_heads=8, head_dim=128, intermediate=17408, vocab=32000,
                      taps=5, tokens=1024, anchors=64),
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

    def active(self):
        """The context in which this implementation's code is the one that runs."""
        return contextlib.nullcontext()

    def step(self) -> float:
        self.model.zero_grad(set_to_none=True)
        loss = self.forward()
        loss.backward()
        return float(loss.detach())

    def grads(self):
        return {k: p.grad for k, p in self.params().items()}


class OursAt(Ours):
    """Ours with `split_block_attention` as it was at a git revision: the same step, weights and
    batch, so a change to the attention is measured before/after in one process."""

    def __init__(self, drafter: DFlashDrafter, b: Batch, g: Geometry, revision: str):
        super().__init__(drafter, b, g)
        # The attention rule's module since it left model.py; model.py at older revisions.
        for path in ("pipeline/drafter/attention_rule.py", "pipeline/drafter/model.py"):
            shown = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=REPO, capture_output=True, text=True)
            if shown.returncode == 0:
                break
        else:
            raise SystemExit(f"{revision}: neither attention_rule.py nor model.py in pipeline/drafter/")
        module = types.ModuleType(f"attention_at_{revision}")
        sys.modules[module.__name__] = module  # dataclasses look their module up
        exec(compile(shown.stdout, f"{revision}:{path}", "exec"), module.__dict__)
        self.split = module.split_block_attention
        self.name = f"ours@{revision}"
        self.attention = f"split_block_attention at {revision}; loss: {LOSS_PATH}"
        self.version = revision

    @contextlib.contextmanager
    def active(self):
        current = attention_rule.split_block_attention
        attention_rule.split_block_attention = self.split
        try:
            yield
        finally:
            attention_rule.split_block_attention = current

    def step(self) -> float:
        with self.active():
            return super().step()


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


def _dist_version(name: str) -> str:
    from importlib.metadata import version
    return version(name)



class GemmFloor:
    """Not an implementation: only the matrix multiplies that any exact implementation of this
    step has to do, as plain `torch.mm` on random tensors of the same shapes, dtype and threads.
    Its time is a lower bound on any step's, so a peer's time over it is the most that any
    implementation of the same objective could lead that peer by (issue 32).

    Counted (forward, weight gradient, input gradient): fc on the context tokens (no input
    gradient: the tapped states are data); per layer the context's k/v projections (T rows), the
    block tokens' k/v projections (Q rows), q/o and the MLP (Q rows, Q - A in the last layer,
    whose slot-0 outputs nothing reads); the frozen lm_head on the supervised slots (forward and
    input gradient only). Left out, so the floor is lower than any real step: attention (its
    score and value products), norms, RoPE, activations, the softmax and every copy; and the
    first layer's block-token projections are counted once per distinct input row (slots 1.. of
    every block are the same mask embedding) rather than Q times."""

    name = "gemm_floor"
    attention = "none: matrix multiplies only (a lower bound on any step)"
    version = "-"

    def __init__(self, g: Geometry, seed: int = 0):
        self.model = nn.Module()  # nothing trainable: the timing loop's zero_grad is a no-op
        gen = torch.Generator().manual_seed(seed)
        h, kv, qd, inter = g.hidden, g.kv_heads * g.head_dim, g.heads * g.head_dim, g.intermediate
        queries, supervised = g.anchors * g.block, g.anchors * (g.block - 1)
        shapes = [(g.tokens, g.taps * h, h, False)]  # (rows, in, out, input gradient needed)
        for layer in range(g.layers):
            last = layer == g.layers - 1
            rows = supervised if last else queries
            block_rows = g.anchors + 1 if layer == 0 else queries  # distinct inputs of the first layer
            shapes += [(g.tokens, h, kv, True)] * 2 + [(block_rows, h, kv, True)] * 2
            shapes += [(block_rows if layer == 0 else rows, h, qd, True), (rows, qd, h, True)]
            shapes += [(rows, h, inter, True)] * 2 + [(rows, inter, h, True)]
        self.products = []  # (a, b) pairs: each is one torch.mm
        for rows, n_in, n_out, input_grad in shapes:
            x = torch.randn(rows, n_in, generator=gen)
            w = torch.randn(n_in, n_out, generator=gen)
            dy = torch.randn(rows, n_out, generator=gen)
            self.products += [(x, w), (x.t(), dy)] + ([(dy, w.t())] if input_grad else [])
        x = torch.randn(supervised, h, generator=gen)
        head = torch.randn(h, g.vocab, generator=gen)
        dlogits = torch.randn(supervised, g.vocab, generator=gen)
        self.products += [(x, head), (dlogits, head.t())]
        self.flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in self.products)

    def step(self) -> float:
        for a, b in self.products:
            torch.mm(a, b)
        return float("nan")
