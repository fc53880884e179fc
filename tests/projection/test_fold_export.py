"""A drafter trained on projected taps, exported with its basis folded into fc: from the full
taps, the export drafts what the trained drafter drafts from the projection (within float
rounding), it is an ordinary drafter on disk (fc reads n_taps x hidden_size values, no trace of
the projection), and without the basis the drafter is written as trained (a checkpoint) and reads
back so."""

import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.drafter.export import export_drafter, load_drafter, read_config
from pipeline.drafter.model import DFlashDrafter, DrafterConfig
from pipeline.errors import PipelineError
from pipeline.eval.speculative_decoding import draft_logits
from pipeline.projection.basis import SecondMoment, fit_basis

H, V, TAPS, R = 32, 64, 3, 40


def projected_drafter(projected_rank=R, seed=0, energy=False):
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, vocab_size=V, target_layer_ids=[1, 3, 5], num_target_layers=8,
                           mask_token_id=V - 1, block_size=6, layer_types=["sliding_attention", "full_attention"],
                           sliding_window=5, projected_rank=projected_rank, projected_energy=energy)
    head = torch.nn.Linear(H, V, bias=False)
    torch.nn.init.normal_(head.weight, std=1.0)
    return DFlashDrafter(config, embed=torch.nn.Embedding(V, H), lm_head=head).eval()


def taps(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(TAPS * H, TAPS * H, generator=g) * torch.logspace(0, -2, TAPS * H)[:, None]
    return (torch.randn(tokens, TAPS * H, generator=g) @ mixing).reshape(tokens, TAPS, H)


@pytest.mark.parametrize("energy", [True, False], ids=["at-energy", "unit"])
@pytest.mark.parametrize("context_len", [4, 17])
def test_the_folded_export_drafts_from_the_full_taps_what_was_trained_on_the_projection(tmp_path, context_len, energy):
    moment = SecondMoment(TAPS * H)
    moment.add(taps(500, seed=1).reshape(500, -1))
    basis = fit_basis(moment, R)
    trained = projected_drafter(energy=energy)
    trained.use_basis(basis)
    export_drafter(trained, tmp_path / "drafter", basis=basis)

    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert "projected_rank" not in raw and "projected_energy" not in raw and read_config(tmp_path / "drafter").projected_rank is None
    assert load_file(str(tmp_path / "drafter" / "model.safetensors"))["fc.weight"].shape == (H, TAPS * H)
    served = load_drafter(tmp_path / "drafter", embed=trained._frozen["embed"], lm_head=trained._frozen["lm_head"]).eval()

    context = taps(context_len, seed=2)      # tokens the basis was not fitted on
    projected = basis.project(context.reshape(context_len, -1)).reshape(context_len, 1, R)
    with torch.no_grad():
        mine = draft_logits(trained, projected, 7, context_len)
        theirs = draft_logits(served, context, 7, context_len)
    torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-4)
    assert theirs.argmax(-1).tolist() == mine.argmax(-1).tolist()


def test_without_the_basis_the_drafter_is_written_as_trained_and_reads_back(tmp_path):
    trained = projected_drafter()
    export_drafter(trained, tmp_path / "checkpoint")
    assert read_config(tmp_path / "checkpoint").projected_rank == R
    back = load_drafter(tmp_path / "checkpoint", embed=trained._frozen["embed"], lm_head=trained._frozen["lm_head"])
    assert torch.equal(back.fc.weight, trained.fc.weight)


def test_a_basis_of_another_shape_is_refused(tmp_path):
    moment = SecondMoment(TAPS * H)
    moment.add(taps(500, seed=1).reshape(500, -1))
    with pytest.raises(PipelineError, match="the basis projects 96 values to 20, the drafter's fc reads 40"):
        export_drafter(projected_drafter(), tmp_path / "drafter", basis=fit_basis(moment, 20))
    assert not (tmp_path / "drafter").exists()


def test_a_projection_as_wide_as_the_taps_is_refused():
    with pytest.raises(ValueError, match="projected_rank must be in"):
        projected_drafter(projected_rank=TAPS * H)


def test_a_drafter_reading_components_at_their_energy_needs_its_basis():
    with pytest.raises(RuntimeError, match="use_basis"):
        projected_drafter(energy=True).context_features(torch.zeros(1, 2, 1, R))


def test_at_their_energy_fc_starts_as_a_whole_tap_fc_restricted_to_the_basis():
    """fc' on z * s with W' ~ N(0, 1/(n*H)): the whole-tap init's statistics, the same draws as the
    unit form (only fc's scale differs), and fc'(z) = W' P x exactly on the projection's x."""
    moment = SecondMoment(TAPS * H)
    moment.add(taps(500, seed=1).reshape(500, -1))
    basis = fit_basis(moment, R)
    unit, energy = projected_drafter(seed=3), projected_drafter(seed=3, energy=True)
    energy.use_basis(basis)
    ratio = energy.fc.weight / unit.fc.weight
    torch.testing.assert_close(ratio, torch.full_like(ratio, (R / (TAPS * H)) ** 0.5))
    for (name, a), (_, b) in zip(unit.named_parameters(), energy.named_parameters()):
        if name != "fc.weight":
            assert torch.equal(a, b), name
    x = taps(9, seed=4).reshape(9, -1)
    z = basis.project(x).reshape(1, 9, 1, R)
    with torch.no_grad():
        got = energy.fc(z.reshape(9, R) * basis.scales)
        want = (energy.fc.weight.double() @ (basis.components.double() @ x.double().T)).T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
