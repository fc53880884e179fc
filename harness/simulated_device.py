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

Autocast (`pipeline.devices.autocast` on the simulated device) follows CUDA's op lists: the ops
of its float16 list run in the autocast dtype, those of its float32 list in float32 (`_Autocast`).

Not simulated (stays for a real GPU, BENCHMARKS.md "What the simulated accelerator cannot
show"): kernels (fla, causal-conv1d, flex attention, bf16 arithmetic as a GPU rounds it),
asynchrony and streams, memory, NCCL, and speed.
"""

from __future__ import annotations

import collections
import contextlib
import functools
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
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":
            host.append(x)
        return x

    _refuse_host_generator(func, args, kwargs)
    wrapped = args                                        # the checks below ask which side each is on
    args, kwargs = _map(unwrap, args), _map(unwrap, kwargs)
    to_host = False
    if func is aten._to_copy.default and "device" in kwargs:
        to_host = not _on_device(kwargs["device"])        # a transfer, either way
        if to_host and isinstance(destination, SimTensor):
            _count("cpu")
    elif func is aten.copy_.default:
        if isinstance(wrapped[1], SimTensor) and not isinstance(destination, SimTensor):
            _count("cpu")                                 # host.copy_(device)
    elif func in _INDEXING:
        _refuse_indexing(func, wrapped)
    elif simulated or _on_device(kwargs.get("device")):
        _refuse_host_operands(func, host, destination)
    if _on_device(kwargs.get("device")):
        kwargs = {**kwargs, "device": torch.device("cpu")}
    if func in _SCALAR_READS:
        _count(_SCALAR_READS[func])
    elif func in _VALUE_SIZED or (func in _INDEXING and simulated and _has_mask(args[1])):
        _count("value-sized")                             # a boolean mask as an index: its nonzero()
    out = func(*args, **kwargs)
    return out if to_host else _wrap(out)


# CUDA's rules for a host tensor in device work (ATen's TensorIterator and indexing code):
# - an element-wise op (TensorIterator) takes one 0-dim host tensor as an input, never as its
#   output, and no host tensor of one or more dimensions;
# - every other op (cat, stack, index_select, searchsorted, matmul, ...) takes no host tensor;
# - indexing takes host indices into a device tensor (they are copied over), and a 0-dim host
#   value to put (also copied), but no device index into a host tensor and no device value into
#   a host tensor;
# - a random draw on the device needs a generator of the device's type.
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
# Element-wise in CUDA's sense (TensorIterator) but without aten's pointwise tag.
_SCALAR_TAKERS = {aten.masked_fill.Tensor, aten.masked_fill_.Tensor, aten.fill.Tensor, aten.fill_.Tensor,
                  aten.rsub.Tensor, aten.floor_divide.default, aten.floor_divide_.Tensor}


def _mixed(func, what: str) -> MixedDevices:
    return MixedDevices(f"Expected all tensors to be on the same device, but found at least two devices, meta "
                        f"(the simulated accelerator) and cpu! ({func}: {what})")


def _refuse_host_operands(func, host: list, destination) -> None:
    if not host:
        return
    wide = [t for t in host if t.dim() > 0]
    if wide:
        raise _mixed(func, f"a host tensor of shape {tuple(wide[0].shape)} mixed into device work")
    if not _elementwise(func):
        raise _mixed(func, "a 0-dim host tensor in an op that is not element-wise; CUDA takes one only "
                           "as an element-wise op's input")
    if _in_place(func) and any(t is destination for t in host):
        raise _mixed(func, "device work written into a 0-dim host tensor")
    if len(host) > 1:
        raise MixedDevices(f"Trying to pass too many CPU scalars to non-CPU kernel! ({func}: {len(host)} 0-dim "
                           f"host tensors; CUDA takes one)")


def _refuse_indexing(func, args) -> None:
    self, indices = args[0], args[1]
    on_device = [isinstance(i, SimTensor) for i in indices if isinstance(i, torch.Tensor)]
    if not isinstance(self, SimTensor):
        if any(on_device):
            raise MixedDevices(f"indices should be either on cpu or on the same device as the indexed tensor "
                               f"(cpu) ({func}: device indices into a host tensor)")
        if len(args) > 2 and isinstance(args[2], SimTensor):
            raise _mixed(func, "device values put into a host tensor")
        return
    if len(args) > 2 and isinstance(args[2], torch.Tensor) and not isinstance(args[2], SimTensor) and args[2].dim() > 0:
        raise _mixed(func, f"host values of shape {tuple(args[2].shape)} put into a device tensor")


def _refuse_host_generator(func, args, kwargs) -> None:
    for g in (*args, *kwargs.values()):
        if isinstance(g, torch.Generator) and g.device.type == "cpu":
            name = func if isinstance(func, torch._ops.OpOverload) else f"torch.{func.__name__}"
            raise MixedDevices(f"Expected a 'meta' (the simulated accelerator) device type for generator but found "
                               f"'cpu' ({name}: a host generator for a draw on the device; CUDA needs "
                               f"torch.Generator(device='cuda'))")


@functools.cache
def _elementwise(func) -> bool:
    """A TensorIterator op, as far as aten's tags tell: pointwise, the in-place form of a pointwise
    op (`lt_` is untagged where `lt` is tagged), a foreach op (its fallback is per-tensor
    element-wise ops) or one of the untagged ones above."""
    if torch.Tag.pointwise in func.tags or func in _SCALAR_TAKERS:
        return True
    name = func.overloadpacket.__name__
    if name.startswith("_foreach_"):
        return True
    if _in_place(func):
        functional = getattr(getattr(aten, name[:-1], None), func._overloadname, None)
        return functional is not None and torch.Tag.pointwise in functional.tags
    return False


def _in_place(func) -> bool:
    name = func.overloadpacket.__name__
    return name.endswith("_") and not name.endswith("__")


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
            _refuse_host_generator(func, args, kwargs)
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


# CUDA autocast's op lists (torch's AMP docs, "CUDA Ops that can autocast to float16" and "... to
# float32"), by name: the simulated device takes them where a GPU would, so the bf16 path of
# training (casts, bf16 activations meeting float32 weights, the frozen bf16 head) runs in the
# suite. Ops outside both lists run in their inputs' dtypes, as on CUDA.
_LOWER_PRECISION = ("__matmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "multi_dot",
                    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "linear",
                    "matmul", "mm", "mv", "prelu", "scaled_dot_product_attention")
_FLOAT32 = ("__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits",
            "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist",
            "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log",
            "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss",
            "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod",
            "reciprocal", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum",
            "renorm", "tan", "triplet_margin_loss")


def _functions(names) -> set:
    """The Python callables a name reaches torch function modes as (torch.x, Tensor.x, F.x, ...)."""
    found = set()
    for name in names:
        for home in (torch, torch.Tensor, torch.nn.functional, torch._C._nn, torch.linalg):
            f = getattr(home, name, None)
            if callable(f):
                found.add(f)
    return found


class _Autocast(TorchFunctionMode):
    """`torch.autocast` for the simulated device: before an op of either list, its floating
    device tensors (float64 aside, as CUDA leaves them) are cast to the list's dtype, above
    autograd, so the casts are in the graph as CUDA's are."""

    lower, float32 = _functions(_LOWER_PRECISION), _functions(_FLOAT32)

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to = self.dtype if func in self.lower else torch.float32 if func in self.float32 else None
        if to is not None:
            def cast(x):
                eligible = isinstance(x, SimTensor) and x.is_floating_point() and x.dtype not in (torch.float64, to)
                return x.to(to) if eligible else x
            args, kwargs = _map(cast, args), _map(cast, kwargs)
        return func(*args, **kwargs)


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
    devices.simulate_accelerator(DEVICE, autocast=_Autocast)
    try:
        with _Factories(), _Creations():
            yield handle
    finally:
        devices.simulate_accelerator(None)
        _state["syncs"] = previous


def host(t: torch.Tensor) -> torch.Tensor:
    """A simulated tensor's host data without counting a sync (for test assertions)."""
    return t._data if isinstance(t, SimTensor) else t
