"""How a token is drawn from a model's logits, the one place for `pipeline generate` and
`pipeline eval`: one warp and the two ways the commands draw from it.

The warp is the one serving engines apply (vLLM, transformers' generate): logits / temperature,
then top-k, then top-p (the smallest set of most likely tokens whose mass reaches top_p; the
most likely token is always kept).

The two draws stay two because each command's tokens are pinned for a given seed (generate's
output files, eval's sampled tokens and taus), and they differ by design:
  - `draw_with`: generate's. One `torch.Generator` per sequence, seeded by the caller (generate:
    by (seed, row, turn)), and `torch.multinomial` from the nucleus as it stands, not
    renormalised (multinomial weighs what it is given); made on the host, where the generators
    live.
  - `draw_keyed`: eval's. Inverse transform sampling with one number per token, each a hash of
    its key (`uniform`: seed, prompt index, position, purpose), from the renormalised warp.
    Keyed, not streamed, so a prompt draws the same tokens alone or in a batch of any size, in
    any order, and one position can have independent numbers for several purposes (speculative
    sampling's draft, acceptance test and residual: pipeline/eval/speculative_sampling.py).

The sampling options are checked here only (`check_sampling`, which `Sampler` runs too): both
commands call it before loading a model, so a bad option is one line before any work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.errors import PipelineError

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, row: int, position: int, purpose: int) -> float:
    """A number in [0, 1) determined by its key alone (53 random bits)."""
    h = _splitmix64(seed & _MASK64)
    for part in (row, position, purpose):
        h = _splitmix64(h ^ (part & _MASK64))
    return (h >> 11) * 2.0 ** -53


def draw(probs: torch.Tensor, u: float) -> int:
    """The token at which the cumulative distribution (in token order) first exceeds u: inverse
    transform sampling with one number. Tokens of probability 0 are never drawn."""
    cdf = probs.double().cumsum(-1)
    # The search value is made where cdf lives (u * its total, one IEEE multiply as on the host):
    # a host tensor here stops every sampled eval on a GPU at its first token.
    index = int(torch.searchsorted(cdf, (cdf[-1:] * u), right=True))
    return min(index, probs.shape[-1] - 1)


def draw_rows(probs_NV: torch.Tensor, us: list[float]) -> list[int]:
    """`draw` for each row with its own number, in one read back to the host (one GPU sync for
    all rows instead of one each); the same tokens as `draw` row by row."""
    cdf = probs_NV.double().cumsum(-1)
    values = cdf[:, -1:] * torch.tensor(us, dtype=torch.float64, device=cdf.device)[:, None]
    index = torch.searchsorted(cdf, values, right=True)[:, 0].clamp_max(probs_NV.shape[-1] - 1)
    return index.tolist()


def check_sampling(temperature: float, top_p: float = 1.0, top_k: int = 0) -> None:
    """The one rule for the sampling options, as `pipeline eval` and `pipeline generate` take them
    (temperature 0: greedy; a command without --top-k leaves it 0): a PipelineError naming the
    option as the user types it. Written as `not (ok)` so that NaN is refused too."""
    if not temperature >= 0:
        raise PipelineError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise PipelineError(f"--top-p must be in (0, 1], got {top_p}")
    if not top_k >= 0:
        raise PipelineError(f"--top-k must be >= 0 (0: off), got {top_k}")
    shaping = [f"--top-p {top_p:g}"] * (top_p != 1) + [f"--top-k {top_k}"] * (top_k != 0)
    if temperature == 0 and shaping:
        # Greedy ignores them: taking them silently would pass off greedy output as sampled.
        raise PipelineError(f"{' and '.join(shaping)} shape{'s' if len(shaping) == 1 else ''} sampling: give "
                            f"--temperature > 0 with {'it' if len(shaping) == 1 else 'them'} (0 is greedy)")


@dataclass(frozen=True)
class Sampler:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0                # 0: no top-k

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.top_k)
        if self.temperature == 0:
            raise PipelineError("--temperature 0 is greedy decoding, which draws nothing: a Sampler needs --temperature > 0")

    def nucleus(self, logits: torch.Tensor) -> torch.Tensor:
        """Probabilities [..., V] (float32) after temperature, top-k and top-p, the tokens top-p
        drops zeroed and the rest left as they are (they sum to less than 1 when top-p cut)."""
        scaled = logits.float() / self.temperature
        if self.top_k and self.top_k < scaled.shape[-1]:
            kth = scaled.topk(self.top_k, dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs      # mass of the more likely tokens
            drop = before >= self.top_p                          # the most likely token is always kept
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        return probs

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """Probabilities [..., V] (float32): the nucleus, renormalised."""
        probs = self.nucleus(logits)
        # Without a top-p cut the softmax sums to 1 already: dividing would only move its rounding.
        return probs / probs.sum(-1, keepdim=True) if self.top_p < 1 else probs

    def draw_with(self, logits_RV: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
        """generate's draw: row r's token by `torch.multinomial` with generators[r] from the
        nucleus. Made on the host, where the generators are (and so with the host's softmax
        whatever device the logits come from)."""
        kept = self.nucleus(logits_RV.cpu())
        return [int(torch.multinomial(p, 1, generator=g)) for p, g in zip(kept, generators)]

    def draw_keyed(self, logits_RV: torch.Tensor, us: list[float]) -> list[int]:
        """eval's draw: row r's token by inverse transform sampling with us[r] (a `uniform`) from
        the warp, made where the logits are, in one read back to the host."""
        return draw_rows(self.warp(logits_RV), us)
