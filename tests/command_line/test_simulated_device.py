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
