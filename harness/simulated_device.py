"""A simulated accelerator: a device that is not the host, for a CPU-only test suite.

On a CPU machine host and device are one place, so a tensor made on the host and mixed into
device work (the `torch.tensor([...])` in a decoding loop, a host mask indexing device logits)
passes every test and fails on the first GPU: CUDA refuses an op whose tensors live on two
devices. Under `simulated_accelerator()` the pipeline's device (`--device auto` and `sim`) is a
simulated one: its tensors hold their values in host memory, compute with the host's kernels
(so results equal a host run's bit for bit), and report their device as `meta`. An op that mixes
one with a host tensor of one or more dimensions raises as CUDA raises (0-dim host tensors and
Python numbers are allowed, as CUDA allows them); moving in and out (`.to()`, `.cpu()`, `copy_`)
works; reading values on the host (`.item()`, `float()`, `int()`, `bool()`, `.tolist()`, a
`.cpu()`, an op whose output size depends on values) works and is counted, since each one makes
a real GPU wait for its queue: `Simulated.syncs`.

Why `meta` and not a device of its own: CPU-only torch has no other device type whose C++ device
guard works without a compiled backend; a wrapper reporting a renamed `privateuseone` device fails
at the first indexing ("PyTorch is not linked with support for ... devices", tried). `meta` has a
no-op guard, and nothing in the pipeline makes data-less meta tensors on purpose: one that
appears while the simulation is on is a leak of the simulation itself and raises.

How: `SimTensor` is a wrapper tensor subclass (`_make_wrapper_subclass` + `__torch_dispatch__`,
the mechanism DTensor uses): it unwraps its host data for each aten op, runs the op, and wraps
the results. A dispatch mode catches ops that create tensors on the device from nothing
(`empty(device=...)`, a host tensor's `.to(device)`); a function mode catches the factories that
bypass the dispatcher (`torch.tensor(..., device=...)`). It costs a Python call per op: meant for
small models and few tokens.

Not simulated (stays for a real GPU, BENCHMARKS.md "What the simulated accelerator cannot
show"): kernels (fla, causal-conv1d, flex attention, bf16 autocast), asynchrony and streams,
memory, NCCL, and speed.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("meta")
aten = torch.ops.aten

# Ops whose result the host must wait for: a value read back, or an output whose size depends on
# the values (the GPU has to finish before the host knows how much memory to hand out).
_SCALAR_READS = {aten._local_scalar_dense.default: "item", aten.is_nonzero.default: "bool", aten.equal.default: "equal"}
_VALUE_SIZED = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                aten.unique_consecutive.default, aten.repeat_interleave.Tensor}
# A host index tensor into a device tensor is allowed on CUDA (copied over); not a mix.
_HOST_INDICES_ALLOWED = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class Syncs:
    """Host reads of device values, by kind, since the simulation started (or the last `reset`)."""

    def __init__(self):
        self.counts: collections.Counter[str] = collections.Counter()

    def add(self, kind: str) -> None:
        self.counts[kind] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts.clear()


_state: dict = {"syncs": None}


def _count(kind: str) -> None:
    if _state["syncs"] is not None:
        _state["syncs"].add(kind)


def _on_device(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


class MixedDevices(RuntimeError):
    pass


class SimTensor(torch.Tensor):
    """Host data behind a tensor that says it lives on the simulated device."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        assert not isinstance(data, SimTensor) and data.device.type == "cpu", data.device
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=DEVICE, requires_grad=data.requires_grad)
        wrapper._data = data
        return wrapper

    def __repr__(self, **_):
        return f"SimTensor({self._data!r})"

    def tolist(self):
        _count("tolist")
        return self._data.tolist()

    def numpy(self, *_, **__):
        raise TypeError("can't convert meta (simulated accelerator) device type tensor to numpy. "
                        "Use Tensor.cpu() to copy the tensor to host memory first.")

    def __reduce_ex__(self, protocol):
        # torch.save of a device tensor works on CUDA (it is saved with its device); here it is
        # saved as the host tensor it holds, after counting the read.
        _count("save")
        return self._data.__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _map(f, x):
    """f over the tensors in an op's arguments or results (tuples, lists and dicts of them); a
    hand-written pytree walk, since torch's own costs more than the op on these sizes."""
    if isinstance(x, torch.Tensor):
        return f(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map(f, y) for y in x) if not hasattr(x, "_fields") else type(x)(*(_map(f, y) for y in x))
    if isinstance(x, dict):
        return {k: _map(f, v) for k, v in x.items()}
    return x


def _wrap(out):
    return _map(lambda x: x if isinstance(x, SimTensor) else SimTensor(x), out)


def _run(func, args, kwargs):
    """One aten op with at least one simulated tensor or a simulated `device=` among its inputs."""
    host, simulated = [], []
    destination = args[0] if args else None

    def unwrap(x):
        if isinstance(x, SimTensor):
            simulated.append(x)
            return x._data
        if isinstance(x, torch.Tensor) and x.device.type == DEVICE.type:
            _refuse_leak(func, x)                         # made in C++ past both modes: it has no values
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
            host.append(x)
        return x

    args, kwargs = _map(unwrap, args), _map(unwrap, kwargs)
    to_host = False
    if func is aten._to_copy.default and "device" in kwargs:
        to_host = not _on_device(kwargs["device"])
        if to_host and simulated:
            _count("cpu")
        host = []                                         # a transfer, either way
    elif func is aten.copy_.default:
        if simulated and not isinstance(destination, SimTensor):
            _count("cpu")                                 # host.copy_(device)
        host = []
    elif func in _HOST_INDICES_ALLOWED:
        host = []
    if _on_device(kwargs.get("device")):
        kwargs = {**kwargs, "device": torch.device("cpu")}
    if host and simulated:
        raise MixedDevices(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"meta (the simulated accelerator) and cpu! ({func}: a host tensor of shape "
                           f"{tuple(host[0].shape)} mixed into device work)")
    if func in _SCALAR_READS:
        _count(_SCALAR_READS[func])
    elif func in _VALUE_SIZED or (func in _HOST_INDICES_ALLOWED and simulated and _has_mask(args[1])):
        _count("value-sized")                             # a boolean mask as an index: its nonzero()
    out = func(*args, **kwargs)
    return out if to_host else _wrap(out)


def _has_mask(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class _Creations(TorchDispatchMode):
    """Ops that make a device tensor from host inputs or from nothing (`empty(device=...)`, a host
    tensor's `.to(device)`); ops on simulated tensors go to SimTensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, SimTensor) for t in types):
            return NotImplemented
        if _on_device(kwargs.get("device")):
            return _run(func, args, kwargs)
        out = func(*args, **kwargs)
        if type(out) is torch.Tensor and out.device.type == DEVICE.type:
            _refuse_leak(func, out)
        return out


class _Factories(TorchFunctionMode):
    """Factories that bypass the dispatcher (`torch.tensor(data, device=...)`, `Tensor.new_tensor`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _on_device(kwargs["device"]) and not any(isinstance(a, torch.Tensor) for a in args):
            # a factory; `tensor.to(device=...)` goes on to the dispatcher as `_to_copy`
            return _wrap(func(*args, **{**kwargs, "device": torch.device("cpu")}))
        if func is torch.Tensor.new_tensor and isinstance(args[0], SimTensor):
            return _wrap(args[0]._data.new_tensor(*args[1:], **kwargs))
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], SimTensor):
            # A list index becomes a tensor in C++ on the indexed tensor's device, past the modes
            # (a data-less meta tensor here): made a host tensor first, which CUDA takes too.
            args = (args[0], _lists_as_tensors(args[1]), *args[2:])
        out = func(*args, **kwargs)
        if type(out) is torch.Tensor and out.device.type == DEVICE.type:
            _refuse_leak(func, out)
        return out


def _lists_as_tensors(index):
    if isinstance(index, list) and all(isinstance(i, (int, bool)) for i in index):
        return torch.tensor(index)
    if isinstance(index, tuple):
        return tuple(_lists_as_tensors(i) for i in index)
    return index


def _refuse_leak(func, out) -> None:
    raise RuntimeError(f"simulated accelerator: {func} made a data-less meta tensor (a path the simulation "
                       f"does not cover)")


class Simulated:
    """The handle `simulated_accelerator()` yields: the device, and the host syncs counted."""

    def __init__(self):
        self.device = DEVICE
        self.syncs = Syncs()


@contextlib.contextmanager
def simulated_accelerator() -> Iterator[Simulated]:
    """Within: `resolve_device("auto")` and `resolve_device("sim")` give the simulated device
    (float32 under `--dtype auto`), and mixing it with the host raises as CUDA does."""
    from pipeline import devices

    handle = Simulated()
    previous = _state["syncs"]
    _state["syncs"] = handle.syncs
    devices.simulate_accelerator(DEVICE)
    try:
        with _Factories(), _Creations():
            yield handle
    finally:
        devices.simulate_accelerator(None)
        _state["syncs"] = previous


def host(t: torch.Tensor) -> torch.Tensor:
    """A simulated tensor's host data without counting a sync (for test assertions)."""
    return t._data if isinstance(t, SimTensor) else t
