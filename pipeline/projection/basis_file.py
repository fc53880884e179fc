"""A projected cache's basis, kept beside its manifest as basis.safetensors (safetensors: the
format every consumer of the weights already reads, with no code execution on load).

Written once, if absent (the same create-if-absent write that commits shards), before the
manifest: every launcher and every resume then reads the one basis the store holds, so the
shards of a cache are all in one basis however many processes fitted one. The manifest's
`capture.projection.digest` names it; a reader checks the file against that digest.
"""

from __future__ import annotations

import json

from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from pipeline.cache.location import Location
from pipeline.cache.schema import BASIS
from pipeline.errors import PipelineError
from pipeline.projection.basis import TapBasis


def basis_bytes(basis: TapBasis, pilot: str) -> bytes:
    """The file's bytes, the same for the same basis: the metadata is one JSON string with sorted
    keys (safetensors writes a metadata map of several keys in no fixed order)."""
    record = {"energy": basis.energy, "pilot_tokens": basis.pilot_tokens, "pilot": pilot, "digest": basis.digest()}
    return save_safetensors({"components": basis.components.contiguous(), "scales": basis.scales.contiguous()},
                            metadata={"tap_basis": json.dumps(record, sort_keys=True)})


def parse_basis(data: bytes, where: str) -> tuple[TapBasis, dict]:
    """(the basis, its metadata) from a file's bytes; a file that is not one is named."""
    try:
        tensors = load_safetensors(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(json.loads(data[8:8 + header_len])["__metadata__"]["tap_basis"])
        basis = TapBasis(components=tensors["components"].float(), scales=tensors["scales"].float(),
                         energy=float(metadata["energy"]), pilot_tokens=int(metadata["pilot_tokens"]))
    except Exception as e:  # noqa: BLE001 - a torn or foreign file: safetensors, json and key errors
        raise PipelineError(f"{where}: not a tap basis ({type(e).__name__}: {e})") from None
    if basis.components.ndim != 2 or basis.scales.shape != (basis.projected_rank,):
        raise PipelineError(f"{where}: not a tap basis (components {tuple(basis.components.shape)}, "
                            f"scales {tuple(basis.scales.shape)})")
    return basis, metadata


def store_basis(location: Location, basis: TapBasis, pilot: str) -> TapBasis:
    """Write the basis if the cache has none yet, and return the one the cache holds (this one, or
    the one another launcher stored first)."""
    location.put_if_absent(BASIS, basis_bytes(basis, pilot))
    stored = read_basis(location)
    assert stored is not None  # just written, or written by another launcher
    return stored


def read_basis(location: Location, digest: str | None = None) -> TapBasis | None:
    """The cache's basis (None if it has none); with `digest`, the one the manifest names, or an
    error saying the file is not it."""
    data = location.read(BASIS)
    if data is None:
        if digest is not None:
            raise PipelineError(f"{location.where(BASIS)}: missing; the manifest says the taps are stored "
                                f"projected onto basis {digest[:12]}, which nothing can read without it")
        return None
    basis, _ = parse_basis(data, location.where(BASIS))
    if digest is not None and basis.digest() != digest:
        raise PipelineError(f"{location.where(BASIS)}: basis {basis.digest()[:12]} is not the manifest's "
                            f"{digest[:12]}: the file was replaced or damaged")
    return basis


def cache_basis(reader) -> TapBasis | None:
    """The basis of the cache `reader` reads (pipeline/cache/reader.py), checked against its
    manifest's digest; None for a cache of whole taps."""
    projection = reader.manifest.identity.capture.projection
    return None if projection is None else read_basis(reader.location, projection.digest)
