"""The tap basis (pipeline/projection/basis.py) against numpy's SVD of the pilot itself: the right
singular vectors of X are the eigenvectors of X^T X, the squared singular values their energy; and
the fold against fc' applied to the projection."""

import numpy as np
import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.projection.basis import SecondMoment, fit_basis


def pilot(tokens=400, dim=48, seed=0):
    """Tokens with a decaying spectrum and a non-zero mean (as hidden states have), float32."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(dim, dim, generator=g) * torch.logspace(0, -3, dim)[:, None]
    return (torch.randn(tokens, dim, generator=g) @ mixing + 0.5).float()


def moment_of(x, batches=5):
    m = SecondMoment(x.shape[1])
    for part in torch.tensor_split(x, batches):
        m.add(part)
    return m


@pytest.mark.parametrize("projected_rank", [1, 8, 30])
def test_the_basis_is_the_pilots_top_singular_subspace_with_its_energy(projected_rank):
    x = pilot()
    basis = fit_basis(moment_of(x), projected_rank)
    _, s, vt = np.linalg.svd(x.double().numpy(), full_matrices=False)
    top = vt[:projected_rank]
    # the same subspace: equal orthogonal projectors (individual vectors may differ in sign)
    np.testing.assert_allclose(basis.components.double().numpy().T @ basis.components.double().numpy(), top.T @ top,
                               atol=1e-5)
    assert basis.energy == pytest.approx(float((s[:projected_rank] ** 2).sum() / (s ** 2).sum()), rel=1e-9)
    assert moment_of(x).energy_kept([projected_rank])[projected_rank] == pytest.approx(basis.energy, rel=1e-12)
    np.testing.assert_allclose(basis.scales.double().numpy(), s[:projected_rank] / np.sqrt(len(x)), rtol=1e-5)
    z = basis.project(x)
    np.testing.assert_allclose(z.double().pow(2).mean(0).numpy(), np.ones(projected_rank), rtol=1e-4)   # one fp8 scale fits all


@pytest.mark.parametrize("tokens,projected_rank", [(40, 12), (96, 30), (97, 30)])
def test_a_pilot_narrower_than_the_taps_gives_the_same_basis_through_its_gram_matrix(tokens, projected_rank):
    # 40 and 96 tokens of 96 values: the rows are kept and X X^T decomposed; 97: the moment.
    x = pilot(tokens=tokens, dim=96)
    basis = fit_basis(moment_of(x, 3), projected_rank)
    _, s, vt = np.linalg.svd(x.double().numpy(), full_matrices=False)
    top = vt[:projected_rank]
    np.testing.assert_allclose(basis.components.double().numpy().T @ basis.components.double().numpy(), top.T @ top,
                               atol=1e-5)
    np.testing.assert_allclose(basis.scales.double().numpy(), s[:projected_rank] / np.sqrt(tokens), rtol=1e-5)
    assert moment_of(x).energy_kept([projected_rank, 95])[95] == pytest.approx(float((s[:95] ** 2).sum() / (s ** 2).sum()),
                                                                     rel=1e-9)


def test_the_fold_on_the_full_taps_computes_fc_prime_on_the_projection():
    x = pilot()
    basis = fit_basis(moment_of(x), 12)
    fc_prime = torch.randn(16, 12, generator=torch.Generator().manual_seed(1))
    np.testing.assert_allclose((x @ basis.fold(fc_prime).T).numpy(), (basis.project(x) @ fc_prime.T).numpy(),
                               rtol=1e-4, atol=1e-4)


def test_a_refit_on_the_same_pilot_has_the_same_digest_and_batches_do_not_matter():
    x = pilot()
    one, other = fit_basis(moment_of(x, 1), 10), fit_basis(moment_of(x, 7), 10)
    assert one.digest() == other.digest()
    assert one.digest() != fit_basis(moment_of(pilot(seed=1)), 10).digest()


def test_ranks_that_save_nothing_or_that_the_pilot_does_not_span_are_refused():
    x = pilot(dim=48)
    with pytest.raises(PipelineError, match="saves nothing"):
        fit_basis(moment_of(x), 48)
    with pytest.raises(PipelineError, match="spans only 5 directions"):
        fit_basis(moment_of(x[:5]), 6)
    with pytest.raises(PipelineError, match="no token"):
        fit_basis(SecondMoment(48), 4)


def test_the_moment_lives_on_the_host_while_its_products_run_on_the_device(monkeypatch):
    """Issue 77.4: beside a target on a GPU, the fit keeps the D x D moment on the host and sends
    the device one batch of rows and one block of columns at a time. Under the simulated
    accelerator (mixing its tensors with the host's raises, as CUDA does) the fit on the device
    gives the host fit's basis, and the moment it holds is a host tensor."""
    from harness.simulated_device import simulated_accelerator

    x = pilot(tokens=300, dim=48)
    monkeypatch.setattr(SecondMoment, "FLUSH_TOKENS", 64)   # several batches and blocks at this size
    monkeypatch.setattr(SecondMoment, "BLOCK", 16)
    on_host = fit_basis(moment_of(x, 7), 12)
    with simulated_accelerator() as sim:
        moment = SecondMoment(48, device=sim.device)
        for part in torch.tensor_split(x, 7):
            moment.add(part.to(sim.device))
        assert type(moment.sum) is torch.Tensor and moment.sum.device.type == "cpu"
        on_device = fit_basis(moment, 12)
    assert torch.equal(on_device.components, on_host.components) and torch.equal(on_device.scales, on_host.scales)
