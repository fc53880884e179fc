"""Does the store honour create-if-absent? Asked once by every extract before it writes a cache.

The commit protocol (DESIGN 11, pipeline/cache/commit.py) rests on one primitive: a
create-if-absent write (`Location.put_if_absent`: S3's conditional PUT with `If-None-Match: *`,
a hard link in a directory) that refuses a second writer of the same key. A store that accepts
the second write instead (some S3-compatible servers and gateways ignore the header) lets two
extract processes both "create" manifest.json, and both commit shards under their own identity
into one cache. So extract writes a probe key twice under the cache's prefix and refuses a store
that accepts the second write.

Cost: three requests on an object store (two conditional writes of 2 bytes, one delete; counted
by tests/cache/test_mixed_identity.py through a relay), a few file operations in a directory; all
under the cache's own prefix, at `.create-if-absent-probe-<random>`; the key is deleted again
whatever the answer. A concurrent extract that lists the prefix meanwhile treats such keys as this
tool's own (pipeline/extract/claim.py `refuse_foreign_content`).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass

from pipeline.cache.location import Location
from pipeline.errors import PipelineError

PROBE_PREFIX = ".create-if-absent-probe-"
PROBE_KEY = re.compile(re.escape(PROBE_PREFIX) + r"[0-9a-f]{32}")


@dataclass(frozen=True)
class ProbeResult:
    key: str
    milliseconds: float

    def record(self) -> dict:
        return {"key": self.key, "milliseconds": round(self.milliseconds, 1)}


def check_create_if_absent(location: Location) -> ProbeResult:
    """Write a fresh probe key twice; the second write must be refused. Raises PipelineError (one
    line naming the store and what it lacks) when the store accepts it, or refuses the first."""
    key = PROBE_PREFIX + uuid.uuid4().hex
    start = time.perf_counter()
    try:
        if not location.put_if_absent(key, b"1\n"):
            raise PipelineError(f"{location.where(key)}: the store reported a new random key as existing, so its "
                                "create-if-absent writes cannot be relied on to hold a cache")
        second_accepted = location.put_if_absent(key, b"2\n")
    except PipelineError:
        try:
            location.delete(key)
        except PipelineError:
            pass  # the first error is the one to report
        raise
    location.delete(key)
    if second_accepted:
        raise PipelineError(
            f"{location.where()}: the store does not honour create-if-absent writes (a second conditional write of "
            f"{key} was accepted{' (S3 If-None-Match: *)' if location.remote else ''}), so two extracts could both "
            "create this cache with different settings; use a store that honours it (AWS S3, MinIO, moto and most "
            "S3-compatible servers do) or a directory")
    return ProbeResult(key, (time.perf_counter() - start) * 1000)
