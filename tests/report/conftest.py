import pytest


@pytest.fixture(scope="session")
def sixty_four_rows_cache(tmp_path_factory, train_rows):
    """A cache of the first 64 training conversations in 2 shards, for the report tests that train
    a short real run (the trackers, report --follow). Tests must not write into it."""
    from harness.built_once import built_once
    from harness.runs import small_cache

    return built_once(tmp_path_factory, "sixty_four", lambda root: small_cache(root, train_rows[:64], 2)) / "cache"
