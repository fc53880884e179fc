"""A basis for the concatenated taps (n*H values a token), fitted on a pilot, and the fold that
turns an fc trained on the projection back into an fc on the full taps.

Uncentred on purpose: fc has no bias (DESIGN 2), and a centred projection approximates a token's
taps as mean + P^T z, whose mean term would need a bias in the exported fc that no engine's DFlash
fc has. Uncentred, x ~ P^T P x and fc(x) ~ W P^T (P x): a linear map of the projection with no
bias, which fc' learns and the export folds back (below). The components are the eigenvectors of the pilot's second
moment sum(x x^T) (accumulated in float64: at n*H = 25,600 a float32 sum over 10^6 tokens loses
the small eigenvalues to rounding), largest first; each is divided by its root mean square on the
pilot, so every stored value has about unit second moment and one fp8 scale fits them all.

    z = (P x) / s                 what the cache stores, R values a token
    fc'(z) = W' z                 what the drafter trains
    fc(x) = (W' diag(1/s) P) x    the export: the same numbers from the full taps
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from pipeline.errors import PipelineError

# An eigenvalue below this fraction of the largest is the pilot's rounding, not a direction it
# spans: a component there would be divided by ~0 (its scale).
_SPANNED = 1e-12


class SecondMoment:
    """sum(x x^T) over a pilot's tokens, in float64, and the token count; the spectrum's top R.

    Held on the host, never on the target's device: at the flagship width (n*H = 25,600) the
    moment is 5.2 GB and a full eigendecomposition beside it another 15 GB (the eigenvectors and
    LAPACK's workspace), 20 GB next to a 54 GB target on an 80 GB GPU. The products that build it
    (the heavy part: tokens x D^2) run on `device` one block of columns at a time (about 1.3 GB at
    that width); the eigendecomposition runs on the host and computes only the top R eigenpairs
    (LAPACK's MRRR driver through scipy: the moment, overwritten in place, plus R x D for the
    vectors). Measured in BENCHMARKS ("The fit's memory").

    While the pilot has fewer tokens than dimensions, its rows are kept instead (float32) and the
    spectrum comes from their Gram matrix X X^T (tokens x tokens): the same nonzero eigenvalues,
    the eigenvectors X^T u / sqrt(lambda), at a fraction of the cost."""

    FLUSH_TOKENS = 4096   # rows sent to the device at once: [4096, 25,600] float64 is 840 MB
    BLOCK = 2048          # moment columns computed at once: [25,600, 2048] float64 is 420 MB

    def __init__(self, dim: int, device: torch.device | str = "cpu"):
        self.dim, self.device = dim, torch.device(device)
        self.rows: list[torch.Tensor] = []    # host float32, not yet in `sum`
        self.sum: torch.Tensor | None = None  # host float64 [D, D], once the pilot is wider than D
        self.tokens = 0
        self.consumed = False

    def add(self, x_ND: torch.Tensor) -> None:
        if x_ND.ndim != 2 or x_ND.shape[1] != self.dim:
            raise ValueError(f"expected tokens x {self.dim}, got {tuple(x_ND.shape)}")
        if self.consumed:
            raise RuntimeError("this moment's spectrum was taken (its matrix overwritten): start another")
        self.tokens += x_ND.shape[0]
        self.rows.append(x_ND.detach().to("cpu", torch.float32))
        if self.sum is None and self.tokens <= self.dim:
            return
        if self.sum is None:  # past the width: the moment is smaller than the rows now
            self.sum = torch.zeros(self.dim, self.dim, dtype=torch.float64)
        if sum(len(r) for r in self.rows) >= self.FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        rows, self.rows = torch.cat(self.rows) if self.rows else None, []
        if rows is None:
            return
        for a in range(0, len(rows), self.FLUSH_TOKENS):
            x = rows[a:a + self.FLUSH_TOKENS].to(self.device, torch.float64)
            for c in range(0, self.dim, self.BLOCK):
                self.sum[:, c:c + self.BLOCK] += (x.T @ x[:, c:c + self.BLOCK]).cpu()

    def spectrum(self, top: int | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(the top eigenvalues descending [K], their eigenvectors as rows [K, D], the total energy
        sum(x^2) = the trace), K = min(top or all, tokens, D); each row's sign fixed (its largest
        entry positive) so a refit on the same pilot gives the same bytes. Rows of zero eigenvalues
        (directions the pilot does not span) are zero. Once: the moment is overwritten."""
        if self.tokens == 0:
            raise PipelineError("the pilot holds no token: nothing to fit a basis on")
        if self.consumed:
            raise RuntimeError("this moment's spectrum was taken already")
        self.consumed = True
        if self.sum is None:
            x = torch.cat(self.rows).to(torch.float64)
            self.rows = []
            gram = x @ x.T
            total = float(gram.trace())
            values, u = _top_eigenpairs(gram, min(top or len(x), len(x)))
            spanned = values > values[0] * _SPANNED
            rows = (u.T @ x) / torch.where(spanned, values, torch.ones_like(values)).sqrt()[:, None]
            rows = rows * spanned[:, None]
        else:
            self._flush()
            total = float(self.sum.trace())
            values, vectors = _top_eigenpairs(self.sum, min(top or self.dim, self.dim))
            self.sum = None
            rows = vectors.T
        signs = torch.sign(rows.gather(1, rows.abs().argmax(1, keepdim=True)))
        signs[signs == 0] = 1
        return values, rows.mul_(signs), total

    def energy_kept(self, projected_ranks: list[int], flag: str = "--energy") -> dict[int, float]:
        """The fraction of the pilot's energy (sum of squares) the top R components keep, per R."""
        for r in projected_ranks:
            check_projected_rank(r, self.dim, flag)
        values, _, total = self.spectrum(top=max(projected_ranks))
        cumulative = values.cumsum(0) / total
        return {r: float(cumulative[min(r, len(values)) - 1]) for r in projected_ranks}


def _top_eigenpairs(matrix: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest eigenvalues of a symmetric float64 matrix (descending, clamped at 0) and their
    eigenvectors as columns, on the host, through LAPACK's dsyevr for that index range alone
    (scipy): the matrix is overwritten in place and only n x k vectors are allocated."""
    from scipy.linalg import eigh

    n = matrix.shape[0]
    # The transpose: Fortran-ordered, as LAPACK wants it (a C-ordered array would be copied first),
    # and the same matrix, since it is symmetric. It shares the tensor's memory: overwritten.
    a = matrix.numpy().T
    values, vectors = eigh(a, subset_by_index=[n - k, n - 1], driver="evr", overwrite_a=True, check_finite=False)
    return (torch.from_numpy(values[::-1].copy()).clamp_min(0),
            torch.from_numpy(vectors[:, ::-1].copy()))


def check_projected_rank(projected_rank: int, dim: int, flag: str = "--project-taps") -> None:
    if projected_rank < 1:
        raise PipelineError(f"{flag} {projected_rank}: must be at least 1")
    if projected_rank >= dim:
        raise PipelineError(f"{flag} {projected_rank}: the taps are {dim} values a token (n_taps x hidden_size); "
                            f"a projection to {projected_rank} saves nothing: leave it out to store the full taps")


@dataclass(frozen=True)
class TapBasis:
    components: torch.Tensor   # [R, D] float32, orthonormal rows, largest energy first
    scales: torch.Tensor       # [R] float32: each component's root mean square on the pilot
    energy: float              # fraction of the pilot's energy the R components keep
    pilot_tokens: int

    @property
    def projected_rank(self) -> int:
        """R: how many components, the values a token the projection stores."""
        return self.components.shape[0]

    @property
    def width(self) -> int:
        return self.components.shape[1]

    def digest(self) -> str:
        """sha256 of the components' and scales' bytes: the basis's identity in a cache and a run."""
        h = hashlib.sha256()
        for t in (self.components, self.scales):
            h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
        return h.hexdigest()

    def project(self, x_ND: torch.Tensor) -> torch.Tensor:
        """z [N, R] = (P x) / s, in float32."""
        return (x_ND.to(torch.float32) @ self.components.T) / self.scales

    def project_taps(self, x_TNH: torch.Tensor) -> torch.Tensor:
        """A sample's taps [T, n_taps, H] as a projected cache stores them: [T, 1, R] float32, on
        the taps' device (the basis is moved there once: `to`)."""
        return self.project(x_TNH.reshape(x_TNH.shape[0], -1))[:, None]

    def reconstruct(self, z_T1R: torch.Tensor, n_taps: int) -> torch.Tensor:
        """The taps [T, n_taps, H] a projected cache's row [T, 1, R] stands for: P^T (s z), the
        full taps' component in the basis. A drafter trained on the projection computes the same
        from it through its folded fc as from the row through fc' (fc P^T s = fc' P P^T = fc')."""
        x = (z_T1R[:, 0].to(torch.float32) * self.scales) @ self.components
        return x.reshape(x.shape[0], n_taps, -1)

    def to(self, device: torch.device | str) -> "TapBasis":
        return TapBasis(components=self.components.to(device), scales=self.scales.to(device), energy=self.energy,
                        pilot_tokens=self.pilot_tokens)

    def fold(self, fc_weight_HR: torch.Tensor) -> torch.Tensor:
        """The fc on the full taps [H, D] that computes what fc' [H, R] computes on the projection."""
        folded = (fc_weight_HR.to(torch.float64) / self.scales.to(torch.float64)) @ self.components.to(torch.float64)
        return folded.to(fc_weight_HR.dtype)


def fit_basis(moment: SecondMoment, projected_rank: int) -> TapBasis:
    check_projected_rank(projected_rank, moment.dim)
    values, rows, total = moment.spectrum(top=projected_rank)
    spanned = int((values > values[0] * _SPANNED).sum())
    if projected_rank > spanned:
        raise PipelineError(f"--project-taps {projected_rank}: the pilot ({moment.tokens} tokens) spans only {spanned} "
                            f"directions; take a larger pilot or a smaller R")
    return TapBasis(components=rows[:projected_rank].to(torch.float32).contiguous(),
                    scales=(values[:projected_rank] / moment.tokens).sqrt().to(torch.float32),
                    energy=float(values[:projected_rank].sum() / total), pilot_tokens=moment.tokens)
