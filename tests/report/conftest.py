import pytest


@pytest.fixture(scope="session")
def sixty_four_rows_cache(tmp_path_factory, train_rows):
    """A cache of the first 64 training conversations in 2 shards, for the report tests that train
    a short real run (the trackers, report --follow). Tests must not write into it."""
    from harness.runs import small_cache

    return small_cache(tmp_path_factory.mktemp("sixty_four"), train_rows[:64], 2)
