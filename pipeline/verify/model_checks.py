"""Checks of a cache that need the target model (DESIGN 10).

`check_tail`: every sample's stored deepest tap, run through the layers after it, the final norm
and the lm_head, must reproduce its stored predictions (a few percent of a forward per sample).
`check_recompute`: a stratified set of samples re-run from the embeddings, every stored tap
compared with every `hidden_states[j]` (catches off-by-one and swapped taps in those samples); in
a projected cache, the stored rows with the projection of the fresh taps (layer offsets and
position shifts around the recorded ones). The tail check needs a stored tap: a projected cache
has none, and `tail_unavailable` says so.
"""

from __future__ import annotations

import random
import time

import numpy as np
import torch

from pipeline.verify.bounded_reads import shard_tokens, sound_shards
from pipeline.verify.check_report import Check, SampleList
from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import (HARD_LABEL, HIDDEN, INPUT_IDS, SAMPLE_ID, SOFT_LABEL, TARGET_ARGMAX,
                                   TARGET_LOGSUMEXP, TARGET_TOPK_IDS, TARGET_TOPK_LOGITS, role_names)
from pipeline.target_model.capture import LogitChunks, logsumexp_, tail_forward
from pipeline.errors import PipelineError
from pipeline.projection.basis import TapBasis
from pipeline.projection.basis_file import cache_basis
from pipeline.target_model.kernels import kernel_record
from pipeline.target_model.internals import KernelCallCounter

# How far a stored prediction may be from the tail recompute, in logits, by hidden format: the
# stored tap is rounded to bf16 (or fp8), so the recompute starts from a slightly different
# input. Measured on the embedded target (BENCHMARKS.md) with a wide margin; the faults verify
# must catch (a tap shifted by a position, taken from the layer before) are far above.
TAIL_TOLERANCE = {"bf16": {"argmax": 0.1, "topk": 0.25, "logsumexp": 0.15},
                  "fp8": {"argmax": 0.5, "topk": 1.5, "logsumexp": 0.6}}


# The rounding-scaled error (ProjectedAlignment) a projected cache's rows may have against the
# projection of a fresh forward, by hidden format, whether the extraction and the check compute in
# float32 or bfloat16. Measured (BENCHMARKS, "verify's recompute on a projected cache") at the
# embedded target's width and at 5 x 5,120 with outlier dimensions: sound caches at most 0.0096
# (bf16) and 0.068 (fp8). The faults are named by the search, not by this bar (one tap a layer
# off measures 0.08 at 5 x 5,120); the bar catches what no layer or shift explains (rows of
# another pilot's basis: 2.0 and more).
PROJECTED_TOLERANCE = {"bf16": 0.05, "fp8": 0.15}


def stratified_picks(reader: CacheReader, shards: list[str], n: int, seed: int) -> list[tuple[str, int]]:
    """(shard, row) pairs for the full recompute (DESIGN 10): one random sample of every shard, the
    longest sample, the truncated ones (as long as max_length), then random ones, up to n; more
    when there are more shards than n, since every shard is covered."""
    rng = random.Random(seed)
    max_length = reader.manifest.identity.capture.max_length
    lengths = [np.diff(reader.shard(name).offsets) for name in shards]
    budget = max(n, len(shards) + 1)
    picks: list[tuple[str, int]] = []

    def take(k: int, row: int) -> None:
        if (shards[k], row) not in picks and len(picks) < budget:
            picks.append((shards[k], row))

    for k in range(len(shards)):
        take(k, rng.randrange(len(lengths[k])))
    longest = max(range(len(shards)), key=lambda k: lengths[k].max())
    take(longest, int(lengths[longest].argmax()))
    for k in range(len(shards)):
        for row in np.flatnonzero(lengths[k] >= max_length):
            take(k, int(row))
    starts = np.cumsum([0] + [len(x) for x in lengths])
    for index in rng.sample(range(int(starts[-1])), min(int(starts[-1]), 2 * budget)):
        k = int(np.searchsorted(starts, index, side="right")) - 1
        take(k, int(index - starts[k]))
    return picks


@torch.no_grad()
def check_recompute(reader: CacheReader, picks, model, tol: float) -> Check:
    """Every picked sample re-run from the embeddings: its stored taps against the fresh forward's
    hidden states (TapAlignment; a projected cache's rows: ProjectedAlignment), its stored
    predictions against the fresh logits."""
    cap = reader.manifest.identity.capture
    try:
        basis = cache_basis(reader)
    except PipelineError as e:  # missing or replaced: the basis check names it; nothing to project with
        return Check("recompute", True, f"skipped: {e}", skipped=True)
    taps = TapAlignment(cap.target_layer_ids) if basis is None else ProjectedAlignment(basis, cap.target_layer_ids)
    argmax_same = topk_same = positions = 0
    # The stored argmax must be a best logit of the recompute up to rounding: where two logits are
    # nearly tied (random weights make most positions so; a real model some), another reduction
    # order (tensor parallelism, bf16, another kernel) legitimately picks the other one, so exact
    # agreement is reported, not required (the tail recompute's rule and tolerance).
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    shortfall_tol = TAIL_TOLERANCE[reader.hidden_format]["argmax"] * (4 if bf16 else 1)
    worst_shortfall = 0.0
    counter = KernelCallCounter(model)
    for name, row in picks:
        shard = reader.shard(name)
        sid = int(shard.sample_ids[row])
        sample = shard.sample(sid)
        ids = torch.from_numpy(sample[INPUT_IDS].astype(np.int64))[None]
        with counter:
            out = model(input_ids=ids.to(next(model.parameters()).device), output_hidden_states=True)
        states = torch.stack([h[0].float().cpu() for h in out.hidden_states])  # [L+1, T, H]
        taps.add(states, sample[HIDDEN].float())
        logits = out.logits[0].float().cpu()
        argmax_same += int((logits.argmax(-1).numpy() == sample[TARGET_ARGMAX]).sum())
        stored_argmax = torch.from_numpy(sample[TARGET_ARGMAX].astype(np.int64))
        shortfall = logits.max(-1).values - logits.gather(1, stored_argmax[:, None])[:, 0]
        worst_shortfall = max(worst_shortfall, float(torch.nan_to_num(shortfall, nan=float("inf")).max()))
        k_top = sample[TARGET_TOPK_IDS].shape[1]
        topk_same += int((torch.topk(logits, k_top).indices.numpy() == sample[TARGET_TOPK_IDS]).all(axis=1).sum())
        positions += ids.shape[1]
    now = kernel_record(model, counter.counts)["path"]
    recorded = sorted({reader.manifest.shards[n].kernel_path for n, _ in picks})
    aligned, summary, evidence = taps.verdict(len(picks))
    worst = {"max_abs": taps.max_abs, "max_rel": taps.max_rel, "argmax_shortfall": worst_shortfall}
    passed = aligned and worst["max_rel"] <= tol and worst["argmax_shortfall"] <= shortfall_tol
    error = (f"rounding-scaled error {worst['max_rel']:.3g} rms (tolerance {tol})" if basis is not None
             else f"max abs err {worst['max_abs']:.3g}, rel {worst['max_rel']:.3g} (tolerance {tol})")
    summary += (f"; {error}; "
                f"worst argmax shortfall {worst['argmax_shortfall']:.3g} (tolerance {shortfall_tol:g}); "
                f"argmax agree {argmax_same / max(positions, 1):.4f}, top-k agree {topk_same / max(positions, 1):.4f}; "
                f"kernels now {now}, recorded {'/'.join(map(str, recorded))}")
    if now not in recorded:
        summary += f" (drift between kernel paths: max rel err {worst['max_rel']:.3g})"
    return Check("recompute", passed, summary, {
        **evidence, **worst, "argmax_shortfall_tolerance": shortfall_tol,
        "argmax_agreement": argmax_same / max(positions, 1), "topk_agreement": topk_same / max(positions, 1),
        "kernel_path_now": now, "kernel_path_recorded": recorded, "samples": len(picks),
        "picked": [f"{name} row {row}" for name, row in picks]})


SHIFTS = (-1, 0, 1)  # position shifts tried: stored[t] against the fresh forward's [t - shift]


def shifted_error(stored: torch.Tensor, ref: torch.Tensor, d: int) -> float:
    """max |stored[t] - ref[t - d]| over the positions both have (inf where none: a one-token
    sample has no shifted pair, and must not look best at a shift)."""
    a, b = stored[max(d, 0):len(stored) + min(d, 0)], ref[max(-d, 0):len(ref) - max(d, 0)]
    return float((a - b).abs().max()) if len(a) else float("inf")


class TapAlignment:
    """A cache of whole taps: every stored tap against every hidden_states[j], the best j must be
    tap + 1; and against hidden_states[tap + 1] at position shifts -1/0/+1, the best must be 0.
    max_rel: the error relative to the largest magnitude of the tap in the sample."""

    def __init__(self, taps: list[int]):
        self.taps = taps
        self.best_index: dict[int, dict[int, int]] = {t: {} for t in taps}
        self.best_shift: dict[int, int] = {}
        self.max_abs = self.max_rel = 0.0

    def add(self, states: torch.Tensor, stored: torch.Tensor) -> None:
        """states [L+1, T, H]: the fresh forward's hidden states; stored [T, n_taps, H]."""
        for k, tap in enumerate(self.taps):
            err = (states - stored[:, k][None]).abs().amax(dim=(1, 2))         # per hidden_states index
            j = int(err.argmin())
            self.best_index[tap][j] = self.best_index[tap].get(j, 0) + 1
            ref = states[tap + 1]
            shift_err = {d: shifted_error(stored[:, k], ref, d) for d in SHIFTS}
            d_best = min(shift_err, key=shift_err.get)
            self.best_shift[d_best] = self.best_shift.get(d_best, 0) + 1
            abs_err = float((stored[:, k] - ref).abs().max())
            self.max_abs = max(self.max_abs, abs_err)
            self.max_rel = max(self.max_rel, abs_err / max(float(ref.abs().max()), 1e-6))

    def verdict(self, samples: int) -> tuple[bool, str, dict]:
        """(aligned and in place, the summary's first part, evidence)."""
        aligned = all(list(best) == [t + 1] for t, best in self.best_index.items())
        in_place = list(self.best_shift) == [0]
        if not in_place:
            d = max((d for d in self.best_shift if d), key=self.best_shift.get)
            summary = f"hidden states shifted by {d:+d} position (stored[t] matches hidden_states[t{-d:+d}])"
        elif aligned:
            summary = f"{samples} samples: every tap best matches hidden_states[tap+1]"
        else:
            summary = "taps match the wrong layers: " + ", ".join(
                f"tap {t} -> hidden_states{sorted(b)}" for t, b in self.best_index.items() if list(b) != [t + 1])
        return aligned and in_place, summary, {
            "best_hidden_state_index": {str(t): {str(j): c for j, c in b.items()} for t, b in self.best_index.items()},
            "best_position_shift": {str(d): c for d, c in self.best_shift.items()}}


class ProjectedAlignment:
    """A projected cache (pipeline/projection): the stored rows z [T, 1, R] against the fresh taps,
    concatenated in target_layer_ids order and projected with the cache's basis.

    The error is measured where rounding puts it. A relative rounding error d in each tap value
    moves component i of token t by about d * n[t, i], n[t, i] = sqrt(sum_j P_ij^2 x_tj^2) / s_i:
    the size of what feeds that component, whatever its energy and whatever outlier dimensions
    the token has. (Divided by the row's largest component instead, the rounding of the
    low-energy components is amplified by 1/s and a sound bf16 cache fails.) `noise` is the worst
    sample's root mean square of (z - ref) / n: about 2^-9 for bf16 storage, 2^-5 for fp8, plus
    what the recompute's own rounding adds.

    No stored row is one tap, so the alignment evidence is a search, each hypothesis scored by that
    error: every tap taken alone at another hidden_states index (its layer -1/+1, and each other
    tap's layer: a swap), the others in place; and all taps at position shift -1/+1. In place,
    the stored rows must fit hidden_states[tap + 1] at shift 0 better than any of them. A wrong
    layer or order leaves a signal difference far above the rounding in every component it feeds,
    so the search names it however small the rounding bar is."""

    OFFSETS = (-1, 1)

    def __init__(self, basis: TapBasis, taps: list[int]):
        self.basis, self.taps = basis, taps
        self.width = basis.width // len(taps)
        self.squared = basis.components ** 2  # P∘P: the component scales n of a token's taps
        self.best_index: dict[int, dict[int, int]] = {t: {} for t in taps}
        self.best_shift: dict[int, int] = {}
        self.max_abs = self.noise = 0.0

    def candidates(self, k: int, layers: int) -> list[int]:
        """hidden_states indices tried for tap k: its own (tap + 1), one layer either side, and each
        other tap's (within the model's layers + 1 states)."""
        own = self.taps[k] + 1
        tried = [own] + [own + o for o in self.OFFSETS] + [t + 1 for t in self.taps if t != self.taps[k]]
        return list(dict.fromkeys(j for j in tried if 0 <= j < layers))

    def _part(self, states: torch.Tensor, k: int, j: int) -> torch.Tensor:
        """hidden_states[j] in tap k's place, projected: [T, R] (tap k's share of z)."""
        block = self.basis.components[:, k * self.width:(k + 1) * self.width]
        return (states[j].float() @ block.T) / self.basis.scales

    def add(self, states: torch.Tensor, stored: torch.Tensor) -> None:
        """states [L+1, T, H]: the fresh forward's hidden states; stored [T, 1, R]."""
        z = stored[:, 0].float()
        x = states[[t + 1 for t in self.taps]].transpose(0, 1).reshape(len(z), -1).float()   # [T, n*H]
        scale = ((x * x) @ self.squared.T).sqrt() / self.basis.scales                         # n [T, R]
        scale = scale.clamp_min(float(scale.max()) * 1e-6 + 1e-30)
        parts = {(k, j): self._part(states, k, j) for k in range(len(self.taps))
                 for j in self.candidates(k, len(states))}
        ref = sum(parts[k, t + 1] for k, t in enumerate(self.taps))

        def score(fit: torch.Tensor, d: int = 0) -> float:
            """rms of (z[t] - fit[t - d]) / n[t - d] over the positions both have."""
            a = z[max(d, 0):len(z) + min(d, 0)]
            b, n = (v[max(-d, 0):len(v) - max(d, 0)] for v in (fit, scale))
            return float((((a - b) / n).double() ** 2).mean().sqrt()) if len(a) else float("inf")

        in_place = score(ref)
        shifts = {d: score(ref, d) for d in SHIFTS if d}
        # Which hidden_states index each tap's share fits: from the recorded layers, the best single
        # move at a time (one tap to another candidate, or two taps exchanged) until none helps.
        chosen, best = tuple(t + 1 for t in self.taps), in_place
        for _ in range(2 * len(self.taps)):
            trials = {}
            for k in range(len(self.taps)):
                for j in self.candidates(k, len(states)):
                    trials[chosen[:k] + (j,) + chosen[k + 1:]] = None
                for m in range(k + 1, len(self.taps)):
                    swapped = list(chosen)
                    swapped[k], swapped[m] = chosen[m], chosen[k]
                    if all((i, j) in parts for i, j in enumerate(swapped)):
                        trials[tuple(swapped)] = None
            trials.pop(chosen, None)
            scored = {a: score(sum(parts[k, j] for k, j in enumerate(a))) for a in trials}
            move = min(scored, key=scored.get, default=None)
            if move is None or scored[move] >= best:
                break
            chosen, best = move, scored[move]
        for tap, j in zip(self.taps, chosen):
            self.best_index[tap][j] = self.best_index[tap].get(j, 0) + 1
        # A shift is the finding only where it fits better than the layers found: rows of the
        # wrong layers are about as far from their neighbours' projection as from their own.
        d_best = min(shifts, key=shifts.get)
        if shifts[d_best] >= best:
            d_best = 0
        self.best_shift[d_best] = self.best_shift.get(d_best, 0) + 1
        self.max_abs = max(self.max_abs, float((z - ref).abs().max()))
        self.noise = max(self.noise, in_place)

    @property
    def max_rel(self) -> float:
        """The figure check_recompute holds against its tolerance: the rounding-scaled error."""
        return self.noise

    def verdict(self, samples: int) -> tuple[bool, str, dict]:
        """(aligned and in place, the summary's first part, evidence)."""
        in_place = list(self.best_shift) == [0]
        aligned = all(list(b) == [t + 1] for t, b in self.best_index.items())
        if not in_place:
            d = max((d for d in self.best_shift if d), key=self.best_shift.get)
            summary = (f"projected rows shifted by {d:+d} position (stored[t] matches the projection of the "
                       f"taps at t{-d:+d}) in {self.best_shift[d]} of {samples} samples")
        elif not aligned:
            wrong = []
            for t, b in self.best_index.items():
                j = max((j for j in b if j != t + 1), key=b.get, default=None)
                if j is not None:
                    other = next((f", tap {u}'s" for u in self.taps if u + 1 == j and u != t), "")
                    wrong.append(f"tap {t} -> hidden_states[{j}] (tap+1{j - t - 1:+d}{other}) in {b[j]} of {samples}")
            summary = "projected rows match other layers than the taps': " + ", ".join(wrong)
        else:
            summary = (f"{samples} samples: every projected row best matches the projection (basis "
                       f"{self.basis.digest()[:12]}) of hidden_states[tap+1] in place (each tap at its layer -1/+1 "
                       f"and at every other tap's layer, and position shifts -1/+1, tried)")
        return aligned and in_place, summary, {
            "basis": self.basis.digest(), "rank": self.basis.projected_rank,
            "best_hidden_state_index": {str(t): {str(j): c for j, c in b.items()} for t, b in self.best_index.items()},
            "best_position_shift": {str(d): c for d, c in self.best_shift.items()},
            "noise_rms": self.noise}


@torch.no_grad()
def tail_errors(model, lm_head, deepest_tap: int, samples: list[dict], logits_chunk: int = 256) -> list[dict]:
    """Per sample, how far the stored predictions are from the tail recompute: the largest
    shortfall of the stored argmax's logit below the best logit, of |stored top-k logit -
    recomputed|, of |stored logsumexp - recomputed|, with the position of each."""
    lasts = tail_forward(model, deepest_tap, [s["tap"] for s in samples])
    chunks = LogitChunks(lm_head, logits_chunk)
    out = []
    for sample, last in zip(samples, lasts):
        worst = {"argmax": (0.0, -1), "topk": (0.0, -1), "logsumexp": (0.0, -1)}
        for a, logits in chunks(last):
            logits = logits.cpu()
            b = a + len(logits)
            argmax = torch.from_numpy(sample[TARGET_ARGMAX][a:b].astype(np.int64))
            top_ids = torch.from_numpy(sample[TARGET_TOPK_IDS][a:b].astype(np.int64))
            best = logits.max(-1).values
            errors = {
                "argmax": best - logits.gather(1, argmax[:, None])[:, 0],
                "topk": (logits.gather(1, top_ids) - torch.from_numpy(sample[TARGET_TOPK_LOGITS][a:b])).abs().amax(-1),
            }
            errors["logsumexp"] = (logsumexp_(logits, best) - torch.from_numpy(sample[TARGET_LOGSUMEXP][a:b])).abs()
            for key, err in errors.items():
                err = torch.nan_to_num(err, nan=float("inf"))  # a NaN prediction is as wrong as can be
                at = int(err.argmax())
                if float(err[at]) > worst[key][0]:
                    worst[key] = (float(err[at]), a + at)
        out.append(worst)
    return out


def tail_unavailable(capture) -> str | None:
    """Why the tail check cannot run on a cache (None: it can). A projected cache stores no tap:
    each row mixes them all, and the reconstruction of the deepest tap from R components is not
    the tap the layers after it saw, so predictions from it would differ by the projection's
    loss, not by a fault. The stored rows are checked by --recompute instead."""
    if capture.projection is None:
        return None
    return (f"projected cache: the deepest tap is not stored (the taps are mixed into {capture.projected_rank} "
            f"components); --recompute N checks the projected rows and the predictions against a fresh forward instead")


def check_tail(reader: CacheReader, shards: list[str], model, rate: float, seed: int, compute_dtype: str = "float32",
               batch_tokens: int = 8192) -> Check:
    """Every sample (or the --tail-rate fraction): the stored deepest tap, run through the layers
    after it, the final norm and the lm_head, must reproduce the stored argmax, top-k logits and
    logsumexp within the storage tolerance (DESIGN 10). Skipped where `tail_unavailable` says why."""
    cap = reader.manifest.identity.capture
    if (reason := tail_unavailable(cap)) is not None:
        return Check("tail_recompute", True, f"skipped: {reason}", skipped=True)
    deepest, num_layers = max(cap.target_layer_ids), cap.num_hidden_layers
    k = cap.target_layer_ids.index(deepest)
    # Computing in bf16 (on a GPU) adds its own rounding: a wider band, not yet measured on a GPU.
    tol = {key: value * (4 if compute_dtype == "bfloat16" else 1) for key, value in TAIL_TOLERANCE[reader.hidden_format].items()}
    rng = random.Random(seed)
    offending, checked, tokens, worst = SampleList(), 0, 0, {"argmax": 0.0, "topk": 0.0, "logsumexp": 0.0}
    start = time.perf_counter()
    counter = KernelCallCounter(model)

    def run(batch):
        nonlocal checked, tokens
        with counter:
            errors = tail_errors(model, model.lm_head, deepest, batch)
        for sample, err in zip(batch, errors):
            checked += 1
            tokens += len(sample["tap"])
            for key, (value, pos) in err.items():
                worst[key] = max(worst[key], value)
            bad = [f"{key} off by {value:.3g} at position {pos}" for key, (value, pos) in err.items() if value > tol[key]]
            if bad:
                offending.add(sample["shard"], sample[SAMPLE_ID], "; ".join(bad))

    # Windows hold at most ~256 MB of raw taps (about 5,000 tokens at Qwen3.6-27B's width).
    window = max(1, (256 << 20) // (len(cap.target_layer_ids) * cap.hidden_size * 2))
    predictions = role_names(HARD_LABEL, SOFT_LABEL)  # what the tail recompute must reproduce
    for name, shard in sound_shards(reader, shards):
        batch, size = [], 0
        try:
            for _, sid, sample in shard_tokens(shard, predictions, tap=k, max_tokens=window):
                if rate < 1.0 and rng.random() >= rate:
                    continue
                sample.update({"shard": name, SAMPLE_ID: sid})
                if batch and (len(batch) + 1) * max(size, len(sample["tap"])) > batch_tokens:
                    run(batch)
                    batch, size = [], 0
                batch.append(sample)
                size = max(size, len(sample["tap"]))
        except PipelineError:
            pass  # an undecodable chunk: reported by the checksum check; what was read is still checked
        if batch:
            run(batch)
    seconds = time.perf_counter() - start
    layers_run = num_layers - 1 - deepest
    summary = (f"{checked} samples, {tokens} tokens: layers {deepest + 1}..{num_layers - 1} + norm + lm_head from the "
               f"stored tap {deepest} ({layers_run} of {num_layers} layers) reproduce the stored predictions"
               if not offending else f"{checked} samples: {offending.describe()}")
    summary += (f"; worst argmax shortfall {worst['argmax']:.3g}, top-k logit {worst['topk']:.3g}, logsumexp "
                f"{worst['logsumexp']:.3g} (tolerance {tol['argmax']}/{tol['topk']}/{tol['logsumexp']}); {seconds:.1f} s")
    return Check("tail_recompute", not offending, summary, {
        "samples": checked, "tokens": tokens, "rate": rate, "seconds": seconds, "worst": worst, "tolerance": tol,
        "layers_run": layers_run, "num_hidden_layers": num_layers, "layer_fraction": layers_run / num_layers,
        "kernel_path_now": kernel_record(model, counter.counts)["path"], **offending.evidence()})
