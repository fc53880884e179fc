"""Caches as they are on disk, read without the pipeline's own parsers where the test is about
them: the manifest and commit records by the protocol's rule (DESIGN 11), shard digests from the
files' bytes, decoded content compared sample by sample; and deliberate damage (a flipped byte,
an edited record, a removed commit, re-signed digests)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.cache.reader import CacheReader

# The per-token arrays by name, spelled here on purpose: an independent list, not the schema's.
ARRAYS = ("input_ids", "loss_mask", "target_argmax", "target_topk_ids", "target_topk_logits", "target_logsumexp")


def manifest_json(cache: Path) -> dict:
    """The manifest as stored on disk, with "shards" as the commit protocol defines them (DESIGN 11:
    each shard whose digests.json holds a shard record and whose listed files are there with
    those sizes), read without the tool's own parser."""
    manifest = json.loads((Path(cache) / "manifest.json").read_text())
    for record_path in sorted(Path(cache).glob("shard-*/digests.json")):
        listing = json.loads(record_path.read_text())
        files_ok = all((record_path.parent / rel).is_file() and (record_path.parent / rel).stat().st_size == f["bytes"]
                       for rel, f in listing["files"].items())
        if "shard" in listing and files_ok:
            manifest["shards"][record_path.parent.name] = listing["shard"]
    return manifest


def decoded(cache: Path) -> dict[int, dict[str, np.ndarray]]:
    reader = CacheReader(cache)
    out = {}
    for name in reader.shards:
        shard = reader.shard(name)
        for sid in shard.sample_ids:
            sample = {k: shard.read(k, int(sid)) for k in ARRAYS}
            sample["hidden"] = shard.hidden(int(sid)).float().numpy()
            out[int(sid)] = sample
    return out


def assert_same_content(a: Path, b: Path, *, exact: bool = True, atol: float = 0.0) -> None:
    da, db = decoded(a), decoded(b)
    assert sorted(da) == sorted(db), "different sample ids"
    for sid in da:
        for key in (*ARRAYS, "hidden"):
            x, y = da[sid][key], db[sid][key]
            assert x.shape == y.shape, (sid, key)
            if exact or key in ("input_ids", "loss_mask"):
                assert np.array_equal(x, y), (sid, key)
            elif key in ("target_argmax", "target_topk_ids"):
                assert (x == y).mean() > 0.99, (sid, key)
            else:
                np.testing.assert_allclose(x, y, atol=atol, rtol=0.02, err_msg=f"sample {sid} {key}")


def shard_digest(shard_dir: Path) -> str:
    """The digest of a shard as it is on disk, derived from its files' bytes."""
    from pipeline.files import digest_of_files

    return "sha256:" + digest_of_files(hash_files_on_disk(shard_dir))


def hash_files_on_disk(shard_dir: Path) -> dict:
    """{relative path: (size, sha256)} of every file of a shard but digests.json, from disk (a
    '.NAME.tmp-PID' left by a kill inside a small-file write is not a file of the shard)."""
    import hashlib

    return {p.relative_to(shard_dir).as_posix(): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(shard_dir.rglob("*"))
            if p.is_file() and p.name != "digests.json" and not (p.name.startswith(".") and ".tmp-" in p.name)}


def edit_record(cache: Path, name: str, change) -> None:
    """Apply `change` to a committed shard's record (in its digests.json, the commit record), as a
    writer with a bug would have written it."""
    path = Path(cache) / name / "digests.json"
    listing = json.loads(path.read_text())
    change(listing["shard"])
    path.write_text(json.dumps(listing))


def damage_byte(path: Path, at: int, xor: int = 0xFF) -> None:
    """Flip bits of one byte of a file in place (`at` < 0 counts from the end): a chunk that no
    longer decodes, or no longer matches its checksum."""
    data = bytearray(Path(path).read_bytes())
    data[at] ^= xor
    Path(path).write_bytes(bytes(data))


def uncommit(cache: Path, name: str) -> None:
    """Remove a shard's commit record: its files stay, no reader sees them."""
    (Path(cache) / name / "digests.json").unlink()


def resign(cache: Path, name: str) -> None:
    """Make a deliberately edited shard's digests (digests.json and the manifest) match its bytes
    again, so a test reaches the check it is about instead of stopping at the digest check."""
    from pipeline.cache.commit import record_bytes
    from pipeline.files import digest_of_files

    files = hash_files_on_disk(cache / name)
    path = cache / name / "digests.json"
    shard = json.loads(path.read_text())["shard"]
    shard.update(digest="sha256:" + digest_of_files(files), bytes=sum(size for size, _ in files.values()))
    path.write_bytes(record_bytes(files, shard))
