"""The simulated accelerator itself (harness/simulated_device.py) keeps CUDA's rules: an op that
mixes a device tensor with a host tensor of one or more dimensions raises; 0-dim host tensors
and Python numbers mix freely; transfers work; values are the host's; reading a value back is
counted. The rules are CUDA's documented behaviour, written here as the oracle."""

import pytest
import torch

from harness.simulated_device import MixedDevices, SimTensor, simulated_accelerator
from pipeline.devices import resolve_device
from pipeline.errors import PipelineError


def test_mixing_with_a_host_tensor_raises_and_scalars_do_not():
    with simulated_accelerator() as sim:
        x = torch.arange(5.0, device=sim.device)
        assert x.device.type == "meta" and isinstance(x, SimTensor)
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(5)
        with pytest.raises(MixedDevices):
            torch.searchsorted(x.cumsum(-1), torch.tensor([3.0]))   # the sampled-eval bug's shape
        assert (x + torch.tensor(1.0)).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]   # a 0-dim host tensor is a scalar
        assert (x * 2).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
        assert x[torch.tensor([1, 3])].tolist() == [1.0, 3.0]    # host indices are copied over, as CUDA does
        grid = torch.arange(24.0).reshape(2, 6, 2)
        on = grid.to(sim.device)
        assert on[[0, 1]].tolist() == grid[[0, 1]].tolist()      # a Python list as an index
        assert on[1, [0, 2, 5]].tolist() == grid[1, [0, 2, 5]].tolist()
        on[0, [1, 3]] = 7.0
        grid[0, [1, 3]] = 7.0
        assert on.tolist() == grid.tolist()


def test_transfers_and_factories_land_where_they_are_asked_to():
    with simulated_accelerator() as sim:
        host = torch.randn(3, 4)
        on = host.to(sim.device)
        assert isinstance(on, SimTensor)
        back = on.cpu()
        assert type(back) is torch.Tensor and back.device.type == "cpu" and torch.equal(back, host)
        for made in (torch.tensor([1, 2], device=sim.device), torch.zeros(3, device=sim.device),
                     torch.full((2,), 7, device=sim.device), on.new_zeros(2), on.new_tensor([1.0]), torch.zeros_like(on)):
            assert isinstance(made, SimTensor), made
        assert torch.tensor([1, 2], device=sim.device).tolist() == [1, 2]
        with pytest.raises(TypeError, match="numpy"):
            on.numpy()
        target = torch.empty(3, 4)
        target.copy_(on)                                  # device -> host copy
        assert torch.equal(target, host)


def test_results_equal_the_hosts_and_autograd_works():
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 3)
    x = torch.randn(4, 6)
    layer(x).square().sum().backward()
    expected = layer.weight.grad.clone()
    layer.zero_grad()
    with simulated_accelerator() as sim:
        moved = layer.to(sim.device)
        out = moved(x.to(sim.device)).square().sum()
        out.backward()
        assert isinstance(moved.weight.grad, SimTensor)
        assert torch.equal(moved.weight.grad.cpu(), expected)


def test_reads_back_to_the_host_are_counted():
    with simulated_accelerator() as sim:
        x = torch.arange(6.0, device=sim.device)
        sim.syncs.reset()
        float(x.sum())
        int(x.argmax())
        bool((x > 2).any())
        x.tolist()
        x.cpu()
        x[x > 2]                                          # an output sized by the values
        assert sim.syncs.counts == {"item": 3, "tolist": 1, "cpu": 1, "value-sized": 1}   # bool() reads an item
        sim.syncs.reset()
        y = (x * 2 + 1).exp().sum(0)                      # device work alone: nothing read back
        assert sim.syncs.total == 0 and isinstance(y, SimTensor)


def test_auto_resolves_to_the_simulated_device_only_under_it():
    with simulated_accelerator() as sim:
        assert resolve_device("auto", "auto") == (sim.device, torch.float32)
        assert resolve_device("sim", "bfloat16") == (sim.device, torch.bfloat16)
        assert resolve_device("cpu", "auto") == (torch.device("cpu"), torch.float32)
    assert resolve_device("auto", "auto")[0].type in ("cpu", "cuda")
    with pytest.raises(PipelineError, match="sim"):
        resolve_device("sim", "auto")


# What CUDA refuses, from ATen's own checks (TensorIteratorBase::compute_types: one 0-dim CPU
# tensor as an element-wise op's input, never as its output; check_indices_on_cpu_or_selfdevice;
# index_put_ copies only a 0-dim value over; a CUDA draw checks its generator's device type),
# each tried on the simulated device with the message CUDA gives.
def _refused_cases(dev):
    x = torch.arange(6.0, device=dev)
    idx = torch.tensor([1, 3], device=dev)
    host = torch.arange(6.0)
    g = torch.Generator().manual_seed(0)
    return {
        "searchsorted with a 0-dim host value": (lambda: torch.searchsorted(x.cumsum(0), torch.tensor(3.0)), "same device"),
        "index_select with a 0-dim host index": (lambda: x.index_select(0, torch.tensor(2)), "same device"),
        "stack of a device and a host scalar": (lambda: torch.stack([x[0], torch.tensor(1.0)]), "same device"),
        "two host scalars in one element-wise op": (lambda: torch.where(x > 2, torch.tensor(0.0), torch.tensor(1.0)),
                                                     "too many CPU scalars"),
        "device work written into a host scalar": (lambda: torch.tensor(1.0).add_(x[0]), "same device"),
        "device indices into a host tensor": (lambda: host[idx], "indices should be either on cpu"),
        "host values put at device positions": (lambda: x.clone().__setitem__(idx, torch.tensor([7.0, 8.0])), "same device"),
        "device values put into a host tensor": (lambda: host.clone().__setitem__(torch.tensor([1, 3]), x[:2]), "same device"),
        "a device factory with a host generator": (lambda: torch.randn(3, device=dev, generator=g), "generator"),
        "multinomial on the device with a host generator": (lambda: torch.multinomial(x + 1, 1, generator=g), "generator"),
        "exponential_ on the device with a host generator": (lambda: x.clone().exponential_(generator=g), "generator"),
    }


@pytest.mark.parametrize("case", list(_refused_cases("cpu")))
def test_what_cuda_refuses_is_refused(case):
    with simulated_accelerator() as sim:
        run, message = _refused_cases(sim.device)[case]
        with pytest.raises(MixedDevices, match=message):
            run()


def test_what_cuda_allows_passes_with_the_hosts_values():
    """A host scalar in element-wise ops (once, as an input), host indices and a 0-dim host value
    to put: the results equal the same work on the host."""
    def work(x):
        out = [x + torch.tensor(1.0), torch.where(x > 2, torch.tensor(0.0), x), x.masked_fill(x > 2, torch.tensor(9.0)),
               x.clone().lt_(torch.tensor(2.0)).float(), x.clamp(min=torch.tensor(1.0)), x[torch.tensor([1, 2])]]
        y = x.clone()
        y[x > 2] = torch.tensor(0.0)
        y[torch.tensor([0, 1])] = torch.tensor(5.0)
        return out + [y]

    expected = work(torch.arange(6.0))
    with simulated_accelerator() as sim:
        got = work(torch.arange(6.0, device=sim.device))
        assert all(isinstance(t, SimTensor) for t in got)
        assert [t.tolist() for t in got] == [t.tolist() for t in expected]


def planted_draw(probs, u):
    """`pipeline.sampler.draw` as it is tempting to write it: the search value a 0-dim host tensor.
    Right on the CPU; on a GPU searchsorted refuses it."""
    cdf = probs.double().cumsum(-1)
    index = int(torch.searchsorted(cdf, torch.tensor(float(cdf[-1]) * u, dtype=torch.float64), right=True))
    return min(index, probs.shape[-1] - 1)


def test_a_draw_with_a_host_search_value_is_caught():
    from pipeline.sampler import draw

    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), -1)
    us = (0.0, 0.3, 0.999)
    assert [planted_draw(probs, u) for u in us] == [draw(probs, u) for u in us]   # the plant is right on the host
    with simulated_accelerator() as sim:
        on = probs.to(sim.device)
        assert [draw(on, u) for u in us] == [draw(probs, u) for u in us]
        with pytest.raises(MixedDevices, match="searchsorted"):
            planted_draw(on, 0.3)


def test_autocast_on_the_device_casts_as_torchs_autocast_does():
    """bf16 autocast on the simulated device (pipeline.devices.autocast) against torch's own on the
    host, for ops whose lists CPU and CUDA share (linear and matmul down, cross_entropy up; relu in
    neither): the same dtypes, values and float32 gradients, bit for bit. Where the lists part
    (softmax, log_softmax, sum: float32 on CUDA, bf16 on the CPU), CUDA's is taken."""
    from pipeline.devices import autocast

    torch.manual_seed(0)
    layer, x, labels = torch.nn.Linear(8, 5), torch.randn(4, 8), torch.tensor([0, 1, 2, 3])

    def work(layer, x, labels, device):
        with autocast(device, torch.bfloat16):
            h = torch.relu(layer(x))
            scores = h @ h.T
            loss = torch.nn.functional.cross_entropy(h, labels) + torch.nn.functional.cross_entropy(scores, labels)
        loss.backward()
        return [h, scores, loss, layer.weight.grad]

    expected = work(layer, x, labels, torch.device("cpu"))
    assert [t.dtype for t in expected] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    layer.zero_grad()
    with simulated_accelerator() as sim:
        got = work(layer.to(sim.device), x.to(sim.device), labels.to(sim.device), sim.device)
        assert all(isinstance(t, SimTensor) for t in got)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and torch.equal(g.cpu(), e.detach())
        with autocast(sim.device, torch.bfloat16):
            scores = got[1].detach()
            assert [f(scores, -1).dtype for f in (torch.softmax, torch.log_softmax)] == [torch.float32] * 2
            assert scores.sum().dtype == torch.float32
