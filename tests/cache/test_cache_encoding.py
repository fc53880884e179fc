"""One sample's rows are encoded from the schema: every per-token array, in its stored dtype."""

import numpy as np
import pytest
import torch

from pipeline.cache.encoding import decode_hidden, encode_bf16, encode_fp8, encode_rows
from pipeline.cache.schema import HARD_LABEL, HIDDEN_STATE, SOFT_LABEL, array_specs, role_names, token_specs


def target_outputs(tokens=5, taps=2, hidden=8, top_k=3):
    torch.manual_seed(0)
    logits = torch.randn(tokens, top_k).sort(dim=-1, descending=True).values
    ids = torch.randint(0, 100, (tokens, top_k))
    return {"hidden": torch.randn(tokens, taps, hidden), "target_argmax": ids[:, 0], "target_topk_ids": ids,
            "target_topk_logits": logits, "target_logsumexp": logits.logsumexp(-1) + 1.0}


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_rows_hold_every_token_array_in_its_stored_dtype(fmt):
    out = target_outputs()
    rows = encode_rows(fmt, [1, 2, 3, 4, 5], [0, 0, 1, 1, 1], out)
    assert list(rows) == [spec.name for spec in token_specs(fmt)]
    for spec in token_specs(fmt):
        assert rows[spec.name].dtype == np.dtype(spec.dtype), spec.name
        assert len(rows[spec.name]) == 5
    for name in role_names(HARD_LABEL, SOFT_LABEL):
        np.testing.assert_array_equal(rows[name], out[name].numpy())
    if fmt == "bf16":
        np.testing.assert_array_equal(rows["hidden"], encode_bf16(out["hidden"]))
    else:
        bits, scale = encode_fp8(out["hidden"])
        np.testing.assert_array_equal(rows["hidden"], bits)
        np.testing.assert_array_equal(rows["hidden_scale"], scale)
    # fp8 keeps about 2^-4 of each token's largest magnitude; bf16 far more.
    error = (decode_hidden(fmt, rows.__getitem__).float() - out["hidden"]).abs().max()
    assert error <= 0.07 * out["hidden"].abs().max()


def test_a_schema_array_without_values_is_named():
    out = target_outputs()
    del out["target_logsumexp"]
    with pytest.raises(ValueError, match="target_logsumexp"):
        encode_rows("bf16", [1, 2, 3, 4, 5], [1] * 5, out)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_every_array_has_a_role_and_roles_exclude_the_hidden_format(fmt):
    specs = array_specs(fmt)
    assert len({s.name for s in specs}) == len(specs)
    hidden = [s.name for s in specs if s.role == HIDDEN_STATE]
    assert hidden == (["hidden"] if fmt == "bf16" else ["hidden", "hidden_scale"])
    with pytest.raises(ValueError):
        role_names(HIDDEN_STATE)
