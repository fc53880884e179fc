"""Training order over a cache and a prefetching sample stream (issue 5, DESIGN 5).

The order of an epoch is a pure function of (the committed shards and their sample counts,
seed, epoch, mix_shards): shards are shuffled, then taken `mix_shards` at a time (a window), and
the samples of a window are visited in a seeded random order, so each global batch mixes samples
from up to `mix_shards` shards spread over the whole dataset (datasets are often concatenated by
source, and a shard is a contiguous range of rows). It does not depend on the world size; rank r
of W takes global positions r, r+W, r+2W, ..., so the same global batches are formed whatever W
is. The resume state is (epoch, position): how many global positions were consumed.
"""

from __future__ import annotations

import bisect
import queue
import random
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import HARD_LABEL, HIDDEN, SAMPLE_ID, SAMPLE_TOKENS, SOFT_LABEL, role_names


@dataclass(frozen=True, kw_only=True)
class StreamState:
    """Where training stands in the data: versioned, so a future format can refuse an old one."""
    epoch: int = 0
    position: int = 0
    version: int = 1


class EpochOrder:
    """Position -> (shard name, row) for one epoch: shards shuffled, grouped `mix_shards` at a
    time, the rows of each group permuted together. Lazy: memory is one window's permutation
    (4 bytes a sample), not the whole epoch's (caches can hold millions of samples)."""

    def __init__(self, shard_sizes: dict[str, int], seed: int, epoch: int, mix_shards: int = 16):
        if mix_shards < 1:
            raise ValueError(f"mix_shards must be >= 1, got {mix_shards}")
        self.seed, self.epoch = seed, epoch
        self.names = sorted(shard_sizes)
        random.Random(f"{seed}:{epoch}").shuffle(self.names)
        self.starts = [0]  # first position of each shard, in visiting order
        for name in self.names:
            self.starts.append(self.starts[-1] + shard_sizes[name])
        # First position of each window of `mix_shards` shards, and the end.
        self.window_starts = self.starts[:-1][::mix_shards] + [self.starts[-1]]
        self._window: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.starts[-1]

    def _permutation(self, w: int) -> np.ndarray:
        if self._window is None or self._window[0] != w:
            size = self.window_starts[w + 1] - self.window_starts[w]
            rng = np.random.default_rng([self.seed, self.epoch, w, 0x6D1C])
            self._window = (w, rng.permutation(size).astype(np.int64 if size >= 2**31 else np.int32))
        return self._window[1]

    def __getitem__(self, position: int) -> tuple[str, int]:
        if not 0 <= position < len(self):
            raise IndexError(position)
        w = bisect.bisect_right(self.window_starts, position) - 1
        # The window's samples in a seeded order: index -> (shard of the window, row in it).
        index = self.window_starts[w] + int(self._permutation(w)[position - self.window_starts[w]])
        i = bisect.bisect_right(self.starts, index) - 1
        return self.names[i], index - self.starts[i]


def epoch_order(shard_sizes: dict[str, int], seed: int, epoch: int, mix_shards: int = 16) -> list[tuple[str, int]]:
    """The whole order as a list (small caches and tests)."""
    order = EpochOrder(shard_sizes, seed, epoch, mix_shards)
    return [order[p] for p in range(len(order))]


def rank_positions(total: int, start: int, rank: int, world_size: int) -> range:
    """Global positions this rank reads from `start` on: the ranks together read every position
    >= start exactly once, for any world size, so a resume may even change the world size."""
    first = start + ((rank - start) % world_size)
    return range(first, total, world_size)


# Decoded chunks kept per open shard: samples smaller than a chunk (short conversations, small
# targets) would otherwise decode the same chunk once per sample in a shuffled pass.
CHUNK_CACHE_BYTES = 256 * 2**20


class _Failure:
    """An exception crossing from a loader process; re-raised as itself (one clean message)."""

    def __init__(self, error: BaseException):
        self.error = error


# Samples read ahead on a thread when the step runs on an accelerator (its host thread mostly
# waits on the device, so the reading overlaps it).
ACCELERATOR_READ_AHEAD = 16


def read_ahead(prefetch: int | None, device: torch.device) -> int:
    """Samples a rank reads ahead on a thread: `prefetch` when given; else ACCELERATOR_READ_AHEAD
    on an accelerator and 0 on the CPU (read in the training thread): beside a CPU step a loader
    thread takes a core from torch's OpenMP workers a few milliseconds at a time, and every
    parallel region then waits at its barrier for it. Measured on 2 cores, the demo's steps fed
    by the thread take 1.4-1.6x as long as from memory, and 1.0x read in the training thread
    (BENCHMARKS "The newcomer's hour")."""
    if prefetch is not None:
        return prefetch
    return 0 if device.type == "cpu" else ACCELERATOR_READ_AHEAD


class SampleStream:
    """Decoded samples in epoch order for one rank: read ahead (bounded queue) on a thread, read
    in the caller's thread (`prefetch=0`), or in `workers` loader processes (no GIL contention
    with the training loop). The order is the same every way: worker w reads every k-th position
    and the loader interleaves them back."""

    FIELDS = role_names(SAMPLE_TOKENS, HARD_LABEL)  # what every training step reads
    SOFT_FIELDS = role_names(SOFT_LABEL)            # added for the KL loss

    def __init__(self, reader: CacheReader, *, seed: int, state: StreamState, rank: int = 0, world_size: int = 1,
                 prefetch: int = 8, fields: tuple[str, ...] = FIELDS, transform=None, workers: int = 0,
                 mix_shards: int = 16):
        """`transform(position, sample)` runs where the reading runs (CPU preparation off the
        training loop); what it returns is what the stream yields."""
        self.reader, self.seed, self.state = reader, seed, state
        self.rank, self.world_size, self.prefetch = rank, world_size, prefetch
        self.fields, self.transform, self.workers, self.mix_shards = fields, transform, workers, mix_shards
        self.sizes = {name: reader.manifest.shards[name].samples for name in reader.shards}

    def epoch(self):
        """Yield (global position, item) for the rest of the current epoch."""
        order = EpochOrder(self.sizes, self.seed, self.state.epoch, self.mix_shards)
        positions = rank_positions(len(order), self.state.position, self.rank, self.world_size)
        if self.workers > 0:
            return self._processes(order, positions)
        if self.prefetch == 0:
            return self._read(order, positions)
        return self._threaded(order, positions, self.prefetch)

    def _processes(self, order: EpochOrder, positions: range):
        from torch.utils.data import DataLoader, IterableDataset, get_worker_info

        stream = self

        class Part(IterableDataset):
            def __iter__(self):
                info = get_worker_info()
                try:
                    yield from stream._threaded(order, positions[info.id::info.num_workers], 2)
                except Exception as e:  # noqa: BLE001 - re-raised in the training process
                    yield _Failure(e)

        # fork: the worker inherits the reader and the transform; nothing is pickled on the way in.
        loader = DataLoader(Part(), batch_size=None, num_workers=self.workers, multiprocessing_context="fork",
                            prefetch_factor=max(1, self.prefetch // self.workers))
        items = iter(loader)
        try:
            for item in items:
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            items._shutdown_workers()

    def _read(self, order: EpochOrder, positions: range):
        """(position, item) for `positions`, read and transformed in the calling thread."""
        # The shards of one window are read together: they stay open (the window's, no more), and
        # share the chunk-cache budget.
        open_shards: OrderedDict = OrderedDict()
        cache_bytes = CHUNK_CACHE_BYTES // min(self.mix_shards, max(1, len(self.sizes)))

        def shard_reader(name: str):
            if name not in open_shards:
                open_shards[name] = self.reader.shard(name, chunk_cache_bytes=cache_bytes)
                if len(open_shards) > self.mix_shards:
                    open_shards.popitem(last=False)
            open_shards.move_to_end(name)
            return open_shards[name]

        for pos in positions:
            name, row = order[pos]
            shard = shard_reader(name)
            sid = int(shard.sample_ids[row])
            sample = {k: shard.read(k, sid) for k in self.fields}
            sample[HIDDEN] = shard.hidden(sid)
            sample[SAMPLE_ID] = sid
            yield pos, (self.transform(pos, sample) if self.transform else sample)

    def _threaded(self, order: EpochOrder, positions: range, prefetch: int):
        q: queue.Queue = queue.Queue(maxsize=prefetch)
        stop = threading.Event()

        def produce():
            try:
                for item in self._read(order, positions):
                    if stop.is_set():
                        return
                    q.put(item)
                q.put(None)
            except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                q.put(e)

        thread = threading.Thread(target=produce, name="sample-prefetch", daemon=True)
        thread.start()
        try:
            while (item := q.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    q.get_nowait()
                except queue.Empty:
                    thread.join(timeout=0.05)
