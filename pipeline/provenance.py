"""Provenance: which code computed the cache, on what, from what (DESIGN 6).

Kernel provenance for the linear-attention ops of transformers' qwen3_5 modeling: transformers
binds each op at import time (hub kernels, then fla / causal_conv1d, then the torch reference)
inside a wrapper closure. `bound_kernels` reads what was bound; `KernelCallCounter` counts what
was actually called during a forward, by wrapping the module globals the layers call through.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path

import torch

# Module-level names in transformers.models.qwen3_5.modeling_qwen3_5 -> the op they implement.
LINEAR_ATTENTION_OPS = {
    "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
}


def _closure_value(fn, name: str):
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and name in code.co_freevars and fn.__closure__:
            return fn.__closure__[code.co_freevars.index(name)].cell_contents
        fn = getattr(fn, "__wrapped__", None)
    return None


def _kind(impl) -> str:
    module = getattr(impl, "__module__", "") or ""
    if module.startswith("fla"):
        return "fla"
    if module.startswith("causal_conv1d"):
        return "causal_conv1d"
    if module.startswith("kernels") or "hub" in module:
        return "hub-kernel"
    return "torch"


def bound_kernels(modeling_module) -> dict:
    """{op: {kind, implementation}}. The wrapper copies the torch function's name onto itself, so
    only its closure tells what it dispatches to: without that closure (transformers renamed its
    internals, or stopped wrapping) the kind is "unknown", never a guess from the name."""
    out = {}
    for attr, op in LINEAR_ATTENTION_OPS.items():
        fn = getattr(modeling_module, attr, None)
        if fn is None:
            continue
        impl = _closure_value(getattr(fn, "_counted_original", fn), "implementation")
        if impl is None:
            out[op] = {"kind": "unknown", "implementation": f"undetermined ({attr} has no 'implementation' closure)"}
            continue
        out[op] = {"kind": _kind(impl), "implementation": f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', '?')}"}
    return out


class KernelCallCounter:
    """Counts calls of each linear-attention op while active (patches the module globals)."""

    def __init__(self, model):
        self.module = sys.modules[type(model).__module__]
        self.counts = {op: 0 for attr, op in LINEAR_ATTENTION_OPS.items() if hasattr(self.module, attr)}
        self._saved: dict[str, object] = {}

    def __enter__(self):
        for attr, op in LINEAR_ATTENTION_OPS.items():
            original = getattr(self.module, attr, None)
            if original is None:
                continue
            self._saved[attr] = original

            @functools.wraps(original)
            def counted(*args, __op=op, __fn=original, **kwargs):
                self.counts[__op] += 1
                return __fn(*args, **kwargs)

            counted._counted_original = original
            setattr(self.module, attr, counted)
        return self

    def __exit__(self, *exc):
        for attr, original in self._saved.items():
            setattr(self.module, attr, original)
        self._saved.clear()


def kernel_record(model, counts: dict[str, int]) -> dict:
    """Per op: what was bound and how often it ran; plus a one-word path for quick comparison."""
    bound = bound_kernels(sys.modules[type(model).__module__])
    ops = {op: {**info, "calls": counts.get(op, 0)} for op, info in bound.items()}
    called = sorted({info["kind"] for info in ops.values() if info["calls"]})
    linear = "linear_attention" in (getattr(getattr(model, "config", None), "layer_types", None) or [])
    if linear and (not bound or any(info["kind"] == "unknown" for info in bound.values())):
        return {"ops": ops, "path": "unknown"}  # linear attention ran through code we cannot identify
    return {"ops": ops, "path": "+".join(called) if called else "none"}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    from pipeline import __version__

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "tool_version": __version__,
        "git_revision": git_revision(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "flash_linear_attention": _version("flash-linear-attention") or _version("fla-core"),
        "causal_conv1d": _version("causal-conv1d") or _version("causal_conv1d"),
        "triton": _version("triton"),
        "zarr": _version("zarr"),
        "cuda": torch.version.cuda,
        "gpu": gpu,
    }


def git_revision() -> str | None:
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def files_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda p: p.name):
        h.update(p.name.encode() + b"\0" + bytes.fromhex(sha256_file(p)))
    return h.hexdigest()


# Hashing 54 GB of weights on every node costs minutes; above this, digest the safetensors
# header (names, dtypes, shapes, offsets) plus the file size instead, and say so.
FULL_DIGEST_LIMIT = 2 * 2**30


def weight_digests(target_dir: Path) -> dict:
    files = sorted(target_dir.glob("*.safetensors")) or sorted(target_dir.glob("*.bin"))
    total = sum(p.stat().st_size for p in files)
    method = "sha256" if total <= FULL_DIGEST_LIMIT else "sha256(safetensors header)+size"
    digests = {}
    for p in files:
        if method == "sha256":
            digests[p.name] = sha256_file(p)
        else:
            with open(p, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                digests[p.name] = f"{hashlib.sha256(f.read(min(n, 1 << 28))).hexdigest()}:{p.stat().st_size}"
    return {"method": method, "files": digests, "bytes": total}


def tokenizer_digest(target_dir: Path) -> str:
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "vocab.json", "merges.txt",
             "special_tokens_map.json")
    return files_digest([target_dir / n for n in names if (target_dir / n).is_file()])
