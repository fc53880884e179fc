"""Training order: a pure function of (shards, seed, epoch), independent of world size, resumable;
its readers (a thread or loader processes) stop when an epoch is abandoned."""

import multiprocessing
import threading

import pytest
import torch
from harness.runs import write_rows

from pipeline.cache.reader import CacheReader
from pipeline.config import ExtractConfig
from pipeline.training.stream import (
    ACCELERATOR_READ_AHEAD,
    EpochOrder,
    SampleStream,
    StreamState,
    epoch_order,
    rank_positions,
    read_ahead,
)
from pipeline.errors import PipelineError
from stages.extract.run import run_extract

SIZES = {"shard-00000": 5, "shard-00001": 3, "shard-00002": 4}


def test_order_is_a_permutation_and_deterministic():
    order = epoch_order(SIZES, seed=1, epoch=0)
    assert sorted(order) == sorted((n, r) for n, c in SIZES.items() for r in range(c))
    assert order == epoch_order(dict(reversed(list(SIZES.items()))), seed=1, epoch=0)
    assert order != epoch_order(SIZES, seed=1, epoch=1)
    assert order != epoch_order(SIZES, seed=2, epoch=0)


def test_order_of_a_huge_cache_is_lazy():
    """10 million samples in 1,000 shards: the order costs one shard's permutation, not the epoch's."""
    import tracemalloc
    sizes = {f"shard-{i:05d}": 10_000 for i in range(1000)}
    tracemalloc.start()
    order = EpochOrder(sizes, seed=0, epoch=3)
    seen = {order[p] for p in (0, 1, 5_000_000, 9_999_999)}
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(order) == 10_000_000 and len(seen) == 4
    assert peak < 4 * 2**20, f"{peak / 2**20:.1f} MiB"
    name, row = order[5_000_000]
    assert name in sizes and 0 <= row < 10_000


def test_each_global_batch_mixes_many_shards():
    """64 shards of a contiguous row range each (the qwen3.6-27b plan), batches of 64: every batch
    draws from many shards (the order used to walk one shard after another)."""
    sizes = {f"shard-{i:05d}": 250 for i in range(64)}
    batch = 64

    def distinct(mix):
        order = epoch_order(sizes, seed=0, epoch=0, mix_shards=mix)
        assert sorted(order) == sorted((n, r) for n, c in sizes.items() for r in range(c))
        return [len({name for name, _ in order[i:i + batch]}) for i in range(0, len(order) - batch + 1, batch)]

    walked, mixed = distinct(1), distinct(16)
    assert max(walked) <= 2
    assert min(mixed) >= 10 and sum(mixed) / len(mixed) > 14  # 16 * (1 - (15/16)**64) = 15.7 expected
    # A window holds 16 shards: the first 16 * 250 positions come from 16 shards only.
    first = epoch_order(sizes, seed=0, epoch=0, mix_shards=16)[:16 * 250]
    assert len({name for name, _ in first}) == 16


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_cover_the_epoch_once_whatever_the_world_size(world_size):
    total = sum(SIZES.values())
    seen = sorted(p for r in range(world_size) for p in rank_positions(total, 0, r, world_size))
    assert seen == list(range(total))
    # The same global batch of world_size positions is formed at every step.
    for step in range(total // world_size):
        batch = sorted(rank_positions(total, 0, r, world_size)[step] for r in range(world_size))
        assert batch == list(range(step * world_size, (step + 1) * world_size))


def test_resume_continues_exactly():
    total = sum(SIZES.values())
    full = list(rank_positions(total, 0, 1, 2))
    resumed = list(rank_positions(total, 6, 1, 2))
    assert resumed == [p for p in full if p >= 6]


@pytest.fixture(scope="module")
def cache(tmp_path_factory, train_rows):
    root = tmp_path_factory.mktemp("stream")
    data = write_rows(root / "convs.jsonl", train_rows[:12])
    run_extract(ExtractConfig(cache=str(root / "cache"), data=[str(data)], num_shards=3), None, progress=False)
    return CacheReader(root / "cache")


def test_stream_reads_every_sample_once_and_resumes(cache):
    stream = SampleStream(cache, seed=0, state=StreamState())
    items = list(stream.epoch())
    assert sorted(s["sample_id"] for _, s in items) == list(range(12))
    first = items[0][1]
    assert first["hidden"].shape[0] == len(first["input_ids"]) == len(first["target_argmax"])
    later = SampleStream(cache, seed=0, state=StreamState(position=5))
    assert [(p, s["sample_id"]) for p, s in later.epoch()] == [(p, s["sample_id"]) for p, s in items if p >= 5]


@pytest.mark.parametrize("workers", [1, 2])
def test_loader_processes_keep_the_exact_order(cache, workers):
    state = StreamState(epoch=2, position=1)
    threaded = [(p, s["sample_id"]) for p, s in SampleStream(cache, seed=3, state=state, rank=1, world_size=2).epoch()]
    processes = SampleStream(cache, seed=3, state=state, rank=1, world_size=2, workers=workers)
    assert [(p, s["sample_id"]) for p, s in processes.epoch()] == threaded
    before = set(multiprocessing.active_children())
    it = processes.epoch()
    next(it)
    loaders = [p for p in multiprocessing.active_children() if p not in before]
    assert len(loaders) == workers
    it.close()  # the loader processes shut down: none is left running
    assert [p for p in loaders if p.is_alive()] == []


def test_a_loader_process_error_reaches_the_trainer_as_itself(cache):
    def broken(position, sample):
        raise PipelineError(f"sample {sample['sample_id']}: planted failure")
    stream = SampleStream(cache, seed=0, state=StreamState(), workers=1, transform=broken)
    before = set(multiprocessing.active_children())
    with pytest.raises(PipelineError, match="planted failure") as failure:
        list(stream.epoch())
    # The traceback still holds the loader's frame, so garbage collection has not stopped the
    # loader process: the stream itself must have.
    assert failure.traceback and [p for p in multiprocessing.active_children() if p not in before] == []


def test_reading_in_the_training_thread_keeps_the_exact_order(cache):
    """`prefetch=0` (the CPU's default): the same (position, sample) sequence as the read-ahead
    thread, read and transformed in the caller's thread."""
    state = StreamState(epoch=1, position=2)
    threaded = [(p, s["sample_id"]) for p, s in SampleStream(cache, seed=5, state=state, rank=0, world_size=2).epoch()]
    readers = set()

    def note_thread(position, sample):
        readers.add(threading.get_ident())
        return sample
    inline = SampleStream(cache, seed=5, state=state, rank=0, world_size=2, prefetch=0, transform=note_thread)
    assert [(p, s["sample_id"]) for p, s in inline.epoch()] == threaded
    assert readers == {threading.get_ident()}


def test_read_ahead_is_a_thread_on_an_accelerator_and_none_on_the_cpu():
    assert read_ahead(None, torch.device("cpu")) == 0
    assert read_ahead(None, torch.device("cuda", 0)) == ACCELERATOR_READ_AHEAD > 0
    assert read_ahead(3, torch.device("cpu")) == 3 and read_ahead(0, torch.device("cuda")) == 0


def test_stream_can_be_abandoned_midway(cache):
    """Closing the epoch midway ends its read-ahead thread before close() returns, though that
    thread is blocked on a full queue, and ends its reading (a sample past what was queued, not
    the rest of the epoch): a trainer that stops early (max_steps, an error) leaks no thread."""
    read, readers = [], set()

    def count(position, sample):   # runs where the reading runs: on the producer thread
        read.append(position)
        readers.add(threading.current_thread())
        return sample
    stream = SampleStream(cache, seed=0, state=StreamState(), prefetch=1, transform=count)
    it = stream.epoch()
    next(it)
    [producer] = readers
    assert producer is not threading.current_thread() and producer.is_alive()   # the check below can fail
    it.close()
    assert not producer.is_alive(), "the producer thread outlives the closed epoch"
    # One sample handed over, one in the queue, one blocked on the full queue, and at most the one
    # it reads after being released: not the epoch's 12.
    assert len(read) <= 4, read


def test_resume_with_another_world_size_reads_the_rest_once():
    total = sum(SIZES.values())
    rest = sorted(p for r in range(3) for p in rank_positions(total, 5, r, 3))
    assert rest == list(range(5, total))
