"""Provenance: which code computed the cache, on what, from what (DESIGN 6): the environment
(versions, git revision), file records and digests of datasets, weights and tokenizers. Which
kernels ran is the target's to say (pipeline/target_model/kernels.py)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import subprocess
from pathlib import Path

import torch

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


def file_records(paths: list[Path]) -> list[dict]:
    """How a dataset's files are recorded (extract's manifest, generate's plan): name, size, sha256."""
    return [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in paths]


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
