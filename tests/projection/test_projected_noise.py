"""--noise-std on a projected cache means what it means on whole taps: the noise training adds to
the stored components has the distribution of full-tap noise of that std, projected and scaled as
the cache stores the taps (oracle: numpy, from the rule z = P x / s)."""

import numpy as np
import torch

from pipeline.projection.basis import SecondMoment, fit_basis
from pipeline.training.batch import context_noise, noise_generator

D, R, N, STD = 96, 24, 40_000, 0.3


def test_noise_on_the_components_is_full_tap_noise_projected():
    g = torch.Generator().manual_seed(0)
    pilot = torch.randn(500, D, generator=g) @ (torch.randn(D, D, generator=g) * torch.logspace(0, -2, D)[:, None])
    moment = SecondMoment(D)
    moment.add(pilot)
    basis = fit_basis(moment, R)
    p, s = basis.components.double().numpy(), basis.scales.double().numpy()
    rng = np.random.default_rng(1)
    oracle = (rng.normal(0.0, STD, size=(N, D)) @ p.T) / s                 # [N, R]
    ours = context_noise((N, 1, R), STD, noise_generator(0, 3, 7), 1.0 / basis.scales)[:, 0].double().numpy()
    np.testing.assert_allclose(ours.std(0), oracle.std(0), rtol=0.04)
    np.testing.assert_allclose(ours.std(0), STD / s, rtol=0.04)
    # independent components in both (the basis is orthonormal)
    for x in (ours, oracle):
        corr = np.corrcoef(x.T)
        assert np.abs(corr - np.eye(R)).max() < 0.05
    # without a scale, the noise is the plain std on every value (whole taps, as before)
    plain = context_noise((N, 3), STD, noise_generator(0, 3, 7)).double().numpy()
    np.testing.assert_allclose(plain.std(0), STD, rtol=0.03)
