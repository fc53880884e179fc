"""Fixtures of the cache tests: the twelve conversations and their reference cache (the faults and
object-store tests compare with it), and a real S3-compatible server per module."""

import pytest

from harness.kill_trials import BATCH_TOKENS, SHARDS


@pytest.fixture(scope="module")
def data(twelve_rows_cache):
    return twelve_rows_cache["data"]


@pytest.fixture(scope="module")
def reference(twelve_rows_cache):
    """The shared cache of these rows (tests/conftest.py): SHARDS shards of BATCH_TOKENS-token batches."""
    assert (SHARDS, BATCH_TOKENS) == (3, 256)  # what the shared cache was extracted with
    return twelve_rows_cache["cache"]


@pytest.fixture(scope="module")
def s3_server():
    """moto's standalone server on 127.0.0.1 (harness/s3_server.py), one per test module."""
    from harness.s3_server import MotoServer

    server = MotoServer()
    yield server
    server.stop()
