"""Where a cache's stored taps came from, judged against a fresh forward of the same sample
(verify-cache's recompute, pipeline/verify/model_checks.py): TapAlignment finds, for each stored
whole tap, the `hidden_states` index and position shift it matches; ProjectedAlignment does the
same for a projected cache's rows, searching each tap's layer and the position shift, and scores
the error in units of the rounding the stored format allows."""

from __future__ import annotations

import torch

from pipeline.projection.basis import TapBasis

# The rounding-scaled error (ProjectedAlignment) a projected cache's rows may have against the
# projection of a fresh forward, by hidden format, whether the extraction and the check compute in
# float32 or bfloat16. Measured (BENCHMARKS, "verify's recompute on a projected cache") at the
# embedded target's width and at 5 x 5,120 with outlier dimensions: sound caches at most 0.0096
# (bf16) and 0.068 (fp8). The faults are named by the search, not by this bar (one tap a layer
# off measures 0.08 at 5 x 5,120); the bar catches what no layer or shift explains (rows of
# another pilot's basis: 2.0 and more).
PROJECTED_TOLERANCE = {"bf16": 0.05, "fp8": 0.15}


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
