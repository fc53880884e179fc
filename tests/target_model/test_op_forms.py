"""Two forms transformers' internals may take that the project must read right or refuse:

- a linear-attention op as an nn.Module (5.25 with the `kernels` package): its forward closes over
  the binding wrapper (`func`); a module without it is a form nobody checked, and `op_function`
  must say so rather than hand back the module (the GPU paths check would then compare the bound
  kernel with itself: a check that cannot fail);
- a linear-attention cache layer of several recurrent states (5.25's `number_of_states`): cutting
  a verified pass back must give each state its own recorded state, not state 0's to all.
"""

import pytest
import torch

from pipeline.target_model.internals import keep_prefix, modeling_module_of, torch_fallback, versions


def as_module(func):
    """An op in the form 5.25 gives it with `kernels`: a module whose forward calls `func`."""
    class Wrapped(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)
    return Wrapped()


class NoFunc(torch.nn.Module):
    def forward(self, x):
        return x


def test_the_module_form_gives_its_wrapped_function():
    def rule(x):
        return x
    assert versions.op_function(as_module(rule)) is rule
    assert versions.op_function(rule) is rule


def test_a_module_without_the_wrapped_function_is_refused_not_returned():
    with pytest.raises(RuntimeError, match="NoFunc.*no `func`"):
        versions.op_function(NoFunc())


def test_the_torch_fallback_refuses_an_op_it_cannot_unwrap(target):
    model = target
    module = modeling_module_of(model)
    saved = module.torch_chunk_gated_delta_rule
    module.torch_chunk_gated_delta_rule = NoFunc()
    try:
        with pytest.raises(RuntimeError, match="no `func`"):
            with torch_fallback(model):
                pass
    finally:
        module.torch_chunk_gated_delta_rule = saved


def recording_layer(states: int, tokens: int):
    """A real transformers linear-attention cache layer of `states` recurrent states, recording,
    after a pass of `tokens` tokens (conv inputs of kernel 4, recurrent states [1, 2, 3, 3])."""
    from transformers.cache_utils import Cache, LinearAttentionLayer

    layer = LinearAttentionLayer(number_of_states=states)
    layer.activate_past_recording()
    for i in range(states):
        layer.update_conv_state(torch.randn(1, 6, 4 + tokens), state_idx=i, conv_kernel_size=4)
        layer.update_recurrent_state(torch.randn(1, 2, 3, 3), state_idx=i)
    return Cache(layers=[layer]), layer


def test_each_recurrent_state_is_cut_back_to_its_own_state():
    from transformers.cache_utils import LinearAttentionLayer
    if "number_of_states" not in LinearAttentionLayer.__init__.__code__.co_varnames:
        pytest.skip("this transformers' linear-attention layers keep one recurrent state")
    tokens, keep = 3, 2
    cache, layer = recording_layer(states=2, tokens=tokens)
    # the recorder's calls, state by state: the state after each of the pass's tokens
    per_call = [[torch.full((1, 2, 3, 3), 10.0 * i + t) for t in range(tokens)] for i in range(2)]
    keep_prefix(cache, tokens, keep, per_call)
    assert torch.equal(layer.recurrent_states[0], per_call[0][keep - 1])
    assert torch.equal(layer.recurrent_states[1], per_call[1][keep - 1])


def test_a_recording_that_does_not_cover_every_state_is_refused():
    from transformers.cache_utils import LinearAttentionLayer
    if "number_of_states" not in LinearAttentionLayer.__init__.__code__.co_varnames:
        pytest.skip("this transformers' linear-attention layers keep one recurrent state")
    cache, _ = recording_layer(states=2, tokens=3)
    with pytest.raises(RuntimeError, match="recorded 1 gated delta rule calls for 1 linear-attention layers of 2"):
        keep_prefix(cache, 3, 1, [[torch.zeros(1, 2, 3, 3)] * 3])
