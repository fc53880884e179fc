"""`pipeline cache-info LOCATION`: what a cache holds, from its records alone (never its arrays):
identity, completeness, provenance grouped by shard, counts and bytes (pipeline/cache/info.py)."""

from __future__ import annotations

from pipeline.cache.info import cache_info
from pipeline.cache.address import open_location


def run_cache_info(cache: str) -> dict:
    location = open_location(cache)
    location.check_reachable()  # no such directory, a missing bucket, refused credentials: one line
    return cache_info(location)
