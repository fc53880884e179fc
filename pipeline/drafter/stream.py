"""Training order over a cache and a prefetching sample stream (issue 5, DESIGN 5).

The order of an epoch is a pure function of (the committed shards and their sample counts,
seed, epoch): shards are shuffled, then the rows inside each shard, so reading stays mostly
sequential within a shard. It does not depend on the world size; rank r of W takes global
positions r, r+W, r+2W, ..., so the same global batches are formed whatever W is. The resume
state is (epoch, position): how many global positions were consumed.
"""

from __future__ import annotations

import bisect
import queue
import random
import threading
from dataclasses import dataclass

from pipeline.cache.reader import CacheReader


@dataclass(frozen=True, kw_only=True)
class StreamState:
    """Where training stands in the data: versioned, so a future format can refuse an old one."""
    epoch: int = 0
    position: int = 0
    version: int = 1


class EpochOrder:
    """Position -> (shard name, row) for one epoch: shards shuffled, rows shuffled within each
    shard. Lazy: memory is one shard's permutation, not the whole epoch (caches can hold
    millions of samples)."""

    def __init__(self, shard_sizes: dict[str, int], seed: int, epoch: int):
        self.seed, self.epoch = seed, epoch
        self.names = sorted(shard_sizes)
        random.Random(f"{seed}:{epoch}").shuffle(self.names)
        self.starts = [0]
        for name in self.names:
            self.starts.append(self.starts[-1] + shard_sizes[name])
        self._rows: tuple[str, list[int]] | None = None

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, position: int) -> tuple[str, int]:
        if not 0 <= position < len(self):
            raise IndexError(position)
        i = bisect.bisect_right(self.starts, position) - 1
        name = self.names[i]
        if self._rows is None or self._rows[0] != name:
            rows = list(range(self.starts[i + 1] - self.starts[i]))
            random.Random(f"{self.seed}:{self.epoch}:{name}").shuffle(rows)
            self._rows = (name, rows)
        return name, self._rows[1][position - self.starts[i]]


def epoch_order(shard_sizes: dict[str, int], seed: int, epoch: int) -> list[tuple[str, int]]:
    """The whole order as a list (small caches and tests)."""
    order = EpochOrder(shard_sizes, seed, epoch)
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


class SampleStream:
    """Decoded samples in epoch order for one rank, read ahead (bounded queue) on a thread, or in
    `workers` loader processes (no GIL contention with the training loop). The order is the same
    either way: worker w reads every k-th position and the loader interleaves them back."""

    FIELDS = ("input_ids", "loss_mask", "target_argmax")
    SOFT_FIELDS = ("target_topk_ids", "target_topk_logits", "target_logsumexp")

    def __init__(self, reader: CacheReader, *, seed: int, state: StreamState, rank: int = 0, world_size: int = 1,
                 prefetch: int = 8, fields: tuple[str, ...] = FIELDS, transform=None, workers: int = 0):
        """`transform(position, sample)` runs where the reading runs (CPU preparation off the
        training loop); what it returns is what the stream yields."""
        self.reader, self.seed, self.state = reader, seed, state
        self.rank, self.world_size, self.prefetch = rank, world_size, prefetch
        self.fields, self.transform, self.workers = fields, transform, workers
        self.sizes = {name: reader.manifest.shards[name].samples for name in reader.shards}

    def epoch(self):
        """Yield (global position, item) for the rest of the current epoch."""
        order = EpochOrder(self.sizes, self.seed, self.state.epoch)
        positions = rank_positions(len(order), self.state.position, self.rank, self.world_size)
        if self.workers > 0:
            return self._processes(order, positions)
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

    def _threaded(self, order: EpochOrder, positions: range, prefetch: int):
        q: queue.Queue = queue.Queue(maxsize=prefetch)
        stop = threading.Event()

        def produce():
            shard = None  # only the shard being read is open: memory stays flat over many shards
            try:
                for pos in positions:
                    if stop.is_set():
                        return
                    name, row = order[pos]
                    if shard is None or shard.path.name != name:
                        shard = self.reader.shard(name, chunk_cache_bytes=CHUNK_CACHE_BYTES)
                    sid = int(shard.sample_ids[row])
                    sample = {k: shard.read(k, sid) for k in self.fields}
                    sample["hidden"] = shard.hidden(sid)
                    sample["sample_id"] = sid
                    q.put((pos, self.transform(pos, sample) if self.transform else sample))
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
