"""One optimizer step of drafter training: a rank's share of the global batch, in micro-batches.

The loss is normalised over the whole global batch (sum(ce*w) / sum(w), DESIGN 3.4): every rank
learns the global sum of weights before its backward, so micro-batches and ranks add up to
exactly the single-process gradient. Metrics are exact sums, reduced across ranks.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from pipeline.cache.schema import SAMPLE_ID
from pipeline.config import Data, Objective, Optimizer, parse_loss
from pipeline.devices import autocast
from pipeline.training.batch import (anchor_generator, context_noise, final_hidden, forward_logits, loss_sum,
                                     noise_generator, pack, placeholder, prepare)
from pipeline.errors import PipelineError
from pipeline.faults import LR_BLOWUP_STEP, planted
from pipeline.schedule import warmup_cosine
from pipeline.training.loss import PLAIN_CE, supervised_loss
from pipeline.training.metrics import add_sums, finish_metrics, hit_sums, metric_sums
from pipeline.training.micro_batches import Sizes, cut, forward_cost_on, per_query_work
from pipeline.training.objectives import needs_distribution


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the `dtype` setting (Job.dtype) on `device`; None: float32 throughout."""
    if dtype == "float32":
        return None
    if dtype == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None


def all_sum(value: torch.Tensor, world: int, device: torch.device) -> torch.Tensor:
    """Sum over ranks, returned on the CPU (NCCL reduces CUDA tensors only, gloo CPU ones)."""
    if world == 1:
        return value.cpu()
    value = value.to(device)
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.cpu()


class StepRunner:
    """One optimizer step over a rank's share of the global batch, in micro-batches."""

    # The path before issue 17 (full [queries, V] logits, then the loss): the reference that
    # benchmarks/training/loss_path.py measures the chunked loss against. Training never sets it.
    full_logits = False
    # Micro-batches in the stream's order, `--micro-batch-sequences` at a time (before issue 59):
    # the reference that benchmarks/training/micro_batches.py measures the cut by size against. Training never
    # sets it.
    stream_order = False

    def __init__(self, plan, drafter, optimizer, params, device, rank, world, *, objective: Objective,
                 optimization: Optimizer, data: Data, seed: int, dtype: str, gamma, noise_scale: torch.Tensor | None = None):
        """`optimization`: the lr schedule's and the clip's settings (`optimizer` is the torch
        optimizer they drive); `noise_scale`: on a projected cache, 1 / each component's scale
        (batch.context_noise). The block size is the drafter's own (drafter.config)."""
        self.plan, self.drafter, self.optimizer, self.params = plan, drafter, optimizer, params
        self.objective, self.optimization, self.data, self.seed = objective, optimization, data, seed
        self.block_size = drafter.config.block_size
        self.noise_scale = noise_scale
        self.device, self.rank, self.world, self.gamma = device, rank, world, gamma
        self.model = drafter
        self.autocast = autocast_dtype(dtype, device)
        self._tokens = 0
        self.plant = planted()  # None outside the tests that plant a bug on purpose
        self.terms = parse_loss(objective.loss)
        self.soft = needs_distribution(self.terms)
        # D-PACE weighs the slots itself: blocks carry the bare mask (no decay: gamma infinite),
        # which is also the loss's normaliser, sum(m) (objectives.py).
        self.dpace_alpha = objective.dpace_alpha if objective.position_weight == "dpace" else None
        self.block_gamma = math.inf if self.dpace_alpha is not None else gamma
        self._term_sums: dict[str, torch.Tensor] = {}
        self.per_query = per_query_work(drafter.config, head_rows=drafter.lm_head_weight.shape[0])
        # How the share is cut depends on the device: on the CPU by the measured cost of a forward,
        # on an accelerator into the fewest forwards (micro_batches.py).
        self.forward_cost = forward_cost_on(device)

    def preparer(self, epoch: int):
        data, config = self.data, self.drafter.config

        def transform(position, sample):
            return sample[SAMPLE_ID], prepare(
                sample, block_size=config.block_size, num_anchors=data.num_anchors, max_length=data.max_length,
                mask_token_id=config.mask_token_id, gamma=self.block_gamma, soft=self.soft,
                generator=anchor_generator(self.seed, epoch, int(sample[SAMPLE_ID])), vocab=self.drafter.draft_vocab)
        return transform

    def noise_std(self, step: int) -> float:
        if self.objective.noise_schedule == "linear":
            return self.objective.noise_std * (1.0 - step / max(1, self.plan.total_steps))
        return self.objective.noise_std

    def lr(self, step: int) -> float:
        lr = warmup_cosine(step, peak=self.optimization.lr, warmup=self.plan.warmup_steps, total=self.plan.total_steps,
                           floor=self.optimization.min_lr_ratio)
        return lr * 1000 if self.plant == "lr_blowup" and step >= LR_BLOWUP_STEP else lr

    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return autocast(self.device, self.autocast)

    def _placeholder(self):
        capture_k = 8 if self.soft else None
        return placeholder(self.drafter.config, capture_k,
                           vocab=self.drafter.draft_vocab is not None)

    def micro_batches(self, items: list) -> list[list]:
        """The rank's share cut into micro-batches of like-size sequences, at most `--micro-batch-sequences`
        a forward (micro_batches.py)."""
        cap = self.plan.micro
        if self.stream_order:
            return [items[i:i + cap] for i in range(0, len(items), cap)]
        sizes = [Sizes.of(seq) for _, seq in items]
        runs = cut(sizes, cap, per_query=self.per_query, forward_cost=self.forward_cost)
        return [[items[i] for i in run] for run in runs]

    def take_tokens(self) -> int:
        tokens, self._tokens = self._tokens, 0
        return tokens

    def _loss(self, packed, with_metrics: bool):
        """(sum of loss * w over the micro-batch, a function returning its metric sums)."""
        if self.full_logits:
            if self.objective.loss not in ("ce", "kl") or self.dpace_alpha is not None or self.drafter.draft_vocab is not None:
                raise PipelineError("the full-logits reference path computes loss 'ce' or 'kl' with decay over the "
                                    "whole vocabulary only")
            with self._autocast():
                logits = forward_logits(self.model, packed)
            rows = packed.weights > 0
            self._term_sums[PLAIN_CE] = self._term_sums.get(PLAIN_CE, 0) + torch.nn.functional.cross_entropy(
                logits[rows].float(), packed.labels[rows].long(), reduction="sum").detach().double()
            return loss_sum(logits, packed, self.objective.loss), lambda: metric_sums(
                logits.detach(), packed.labels, packed.weights, packed.real_blocks)
        with self._autocast():
            final = final_hidden(self.model, packed)
        soft, sums = self.soft, {}
        part, hits = supervised_loss(final, self.drafter.lm_head_weight, packed.labels, packed.weights,
                                     soft_ids=packed.soft_ids if soft else None, soft_probs=packed.soft_probs if soft else None,
                                     with_hits=with_metrics, terms=self.terms, dpace_alpha=self.dpace_alpha, term_sums=sums,
                                     outside=packed.outside)
        for name, value in sums.items():
            self._term_sums[name] = self._term_sums.get(name, 0) + value.detach().double()
        return part, lambda: hit_sums(hits, packed.weights, packed.real_blocks, packed.outside)

    def step(self, batch: list, step: int, *, with_metrics: bool) -> dict:
        items = [(sid, seq) for sid, seq in batch if seq is not None]
        std = self.noise_std(step)
        if std > 0:
            for sid, seq in items:
                seq.hidden = seq.hidden + context_noise(seq.hidden.shape, std, noise_generator(self.seed, step, sid),
                                                        self.noise_scale)
        if self.plant == "random_labels":
            _random_labels(items, self.drafter.lm_head_weight.shape[0], seed=self.seed, step=step)
        tokens = sum(seq.num_tokens for _, seq in items)
        local_w = torch.tensor(sum(float(seq.weights.sum()) for _, seq in items), dtype=torch.float64)
        global_w = float(all_sum(local_w.clone(), self.world, self.device))
        if global_w == 0:
            raise PipelineError(f"step {step}: no supervised slot in the whole global batch (check the cache's loss masks)")
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(step)
        self.optimizer.zero_grad(set_to_none=True)
        self._term_sums = {}
        micro = self.micro_batches(items) or [[]]
        total_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = None
        for i, chunk in enumerate(micro):
            sync = i == len(micro) - 1
            ctx = self.model.no_sync() if (self.world > 1 and not sync) else contextlib.nullcontext()
            seqs = [seq for _, seq in chunk] or [self._placeholder()]
            with ctx:
                packed = pack(seqs, self.block_size).to(self.device)
                part, metric = self._loss(packed, with_metrics)
                (part * (self.world / global_w)).backward()
                total_loss += part.detach().double()  # stays on the device: no sync per micro-batch
                if with_metrics:
                    sums = add_sums(sums, metric())   # summed on the device; read once, at the log line
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.optimization.grad_clip)
        # The step's one read back to the host: the finite check must precede the update.
        norm, local_loss = torch.stack([grad_norm.double(), total_loss]).tolist()
        if not math.isfinite(norm):
            ids = ", ".join(str(sid) for sid, _ in items[:8])
            raise PipelineError(f"step {step}: non-finite gradient norm ({norm}); samples on rank "
                                f"{self.rank}: {ids}. Lower lr, or check these samples with `pipeline verify-cache`")
        self.optimizer.step()
        self._tokens += tokens
        result = {"tokens": tokens, "grad_norm": norm, "lr": self.lr(step), "noise_std": std,
                  "local_loss": local_loss, "global_w": global_w}
        if with_metrics:
            if sums is None:
                sums = {k: torch.zeros_like(v) for k, v in _empty_sums(self.block_size).items()}
                if self.drafter.draft_vocab is not None:
                    sums["outside"] = torch.zeros((), dtype=torch.float64)
            # Each term's share of the loss: every term the loss names, zero on a rank without one.
            terms = [self._term_sums.get(name, torch.zeros((), dtype=torch.float64)) for name in (*self.terms, PLAIN_CE)]
            flat = torch.cat([v.reshape(-1).double().to(self.device) for v in sums.values()]
                             + [t.reshape(1).double().to(self.device) for t in terms] + [total_loss.reshape(1)])
            flat = all_sum(flat, self.world, self.device)
            out, i = {}, 0
            for k, v in sums.items():
                out[k] = flat[i:i + v.numel()].reshape(v.shape)
                i += v.numel()
            result["loss"] = float(flat[-1]) / global_w
            result["loss_terms"] = {name: float(flat[i + j]) / global_w for j, name in enumerate(self.terms)}
            # Unweighted: comparable across objectives and slot weightings (README: Metrics).
            # Over the slots in the loss (a label outside a draft vocabulary has no cross-entropy).
            in_loss = float(out["supervised"]) - float(out.get("outside", 0.0))
            result["ce"] = float(flat[i + len(self.terms)]) / max(in_loss, 1.0)
            result["metrics"] = finish_metrics(out)
        return result


def _empty_sums(block_size: int) -> dict:
    z = torch.zeros((), dtype=torch.float64)
    return {"supervised": z, "top1": z, "top4": z, "top8": z, "blocks": z, "streak1": z, "streak4": z, "streak8": z,
            "slot_hits": torch.zeros(block_size, dtype=torch.float64),
            "slot_count": torch.zeros(block_size, dtype=torch.float64)}


def _random_labels(items: list, vocab: int, *, seed: int, step: int) -> None:
    """The test-only planted fault `random_labels` (pipeline.faults.planted)."""
    for sid, seq in items:
        generator = noise_generator(seed + 1, step, sid)
        seq.labels = torch.randint(vocab, seq.labels.shape, generator=generator)
        if seq.soft_ids is not None:
            seq.soft_ids = torch.randint(vocab, seq.soft_ids.shape, generator=generator)
