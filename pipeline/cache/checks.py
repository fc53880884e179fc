"""The model-free checks of a cache (DESIGN 5, 6, 10), by where each lives:

    structure_checks.py  structure (counts, offsets, dtypes, shapes, chunking), digests, provenance
    chunk_checks.py      checksums (every chunk decoded), finiteness per tap, tap signatures
    label_checks.py      label alignment, top-k consistency

Each returns a `Check` (check_report.py). This module keeps the names `pipeline verify-cache`
(stages/verify.py) imports from here.
"""

from pipeline.cache.bounded_reads import sound_shards
from pipeline.cache.check_report import Check
from pipeline.cache.chunk_checks import check_chunks
from pipeline.cache.label_checks import check_alignment
from pipeline.cache.reader import open_cache
from pipeline.cache.structure_checks import check_digests, check_provenance, check_structure

__all__ = ["Check", "check_alignment", "check_chunks", "check_digests", "check_provenance", "check_structure",
           "open_cache", "sound_shards"]
