"""Who writes a shard: a location without a manifest must be empty (never written into
otherwise), and a shard is claimed for writing unless it is committed or, in a directory, locked
by another process (the lock only saves work; the commit record keeps the cache correct)."""

from __future__ import annotations

import re

from pipeline.cache.commit import shard_committed
from pipeline.files import FileLock, temporary_target
from pipeline.cache.location import Location
from pipeline.cache.schema import BASIS, MANIFEST, shard_lock_name, shard_name
from pipeline.cache.store_probe import PROBE_KEY
from pipeline.distributed import Layout
from pipeline.errors import PipelineError


def refuse_foreign_content(location: Location, projected: bool) -> None:
    """A location without a manifest must be empty (or hold only this tool's lock files): a
    prefix or directory that holds something else is never written into. A projected extract
    stores its basis before the manifest (pipeline/extract/pilot_run.py), so a basis alone is a
    projected cache's start, interrupted or under way in another launcher: a projected extract
    goes on with it (its R is checked against the basis there), a whole-tap one is refused."""
    if location.read(MANIFEST) is not None:
        return
    keys = location.some_keys(20)
    if BASIS in keys and not projected and location.read(MANIFEST) is None:
        raise PipelineError(f"{location.where(BASIS)}: a projected cache's basis, with no manifest.json yet (an "
                            "`extract --project-taps R` started here): rerun that extract with its --project-taps, "
                            "or choose an empty --cache location")
    foreign = [k for k in keys if not _ours(k) and k != BASIS]
    # Another writer of this same cache (a second node starting with this one) may create the
    # manifest and its first shard between the read above and the listing: look once more.
    if foreign and location.read(MANIFEST) is None:
        raise PipelineError(f"{location.where()}: holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''} "
                            "but no cache manifest.json: not a cache; choose an empty --cache location")


def _ours(key: str) -> bool:
    """A key this tool leaves under a cache being created: a shard lock, a directory's temporary of
    the manifest, another extract's store probe (pipeline/cache/store_probe.py) or its temporary."""
    if re.fullmatch(r"\.shard-\d{5}\.lock", key):
        return True
    written = temporary_target(key)  # a directory's temporary (pipeline.files.temporary_for)
    return written == MANIFEST or bool(PROBE_KEY.fullmatch(written or key))


def claim_shard(location: Location, shard: int, layout: Layout, locks: bool) -> tuple[str, FileLock | None]:
    """('write', held lock or None) | ('committed', None) | ('locked', None), decided by the group's
    writer. The lock only saves a second process the work (a directory where flock works): what
    keeps the cache correct is the commit record, checked before and after taking it."""
    state, lock = "write", None
    if layout.is_writer:
        name = shard_name(shard)
        if shard_committed(location, name):
            state = "committed"
        elif locks:
            lock = FileLock(location.root / shard_lock_name(shard))
            try:
                held = lock.acquire(blocking=False)
            except OSError:  # no working flock on this mount (ENOLCK, EOPNOTSUPP): go on without
                held, lock = True, None
            if not held:
                state, lock = "locked", None
            elif shard_committed(location, name):
                if lock is not None:
                    lock.release()  # another process finished it between our two looks
                state, lock = "committed", None
    return layout.broadcast_from_writer(state), lock
