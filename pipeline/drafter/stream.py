"""Training order over a cache and a prefetching sample stream (issue 5, DESIGN 5).

The order of an epoch is a pure function of (the committed shards and their sample counts,
seed, epoch): shards are shuffled, then the rows inside each shard, so reading stays mostly
sequential within a shard. It does not depend on the world size; rank r of W takes global
positions r, r+W, r+2W, ..., so the same global batches are formed whatever W is. The resume
state is (epoch, position): how many global positions were consumed.
"""

from __future__ import annotations

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


def epoch_order(shard_sizes: dict[str, int], seed: int, epoch: int) -> list[tuple[str, int]]:
    """[(shard name, row)] for one epoch: shards shuffled, rows shuffled within each shard."""
    rng = random.Random(f"{seed}:{epoch}")
    names = sorted(shard_sizes)
    rng.shuffle(names)
    order = []
    for name in names:
        rows = list(range(shard_sizes[name]))
        rng.shuffle(rows)
        order += [(name, r) for r in rows]
    return order


def rank_positions(total: int, start: int, rank: int, world_size: int) -> range:
    """Global positions this rank reads from `start` on: the ranks together read every position
    >= start exactly once, for any world size, so a resume may even change the world size."""
    first = start + ((rank - start) % world_size)
    return range(first, total, world_size)


class SampleStream:
    """Decoded samples in epoch order for one rank, read ahead on a thread (bounded queue)."""

    FIELDS = ("input_ids", "loss_mask", "target_argmax")
    SOFT_FIELDS = ("target_topk_ids", "target_topk_logits", "target_logsumexp")

    def __init__(self, reader: CacheReader, *, seed: int, state: StreamState, rank: int = 0, world_size: int = 1,
                 prefetch: int = 8, fields: tuple[str, ...] = FIELDS, transform=None):
        """`transform(position, sample)` runs on the reading thread too (CPU preparation off the
        training loop); what it returns is what the stream yields."""
        self.reader, self.seed, self.state = reader, seed, state
        self.rank, self.world_size, self.prefetch = rank, world_size, prefetch
        self.fields, self.transform = fields, transform
        self.sizes = {name: reader.manifest["shards"][name]["samples"] for name in reader.shards}

    def epoch(self):
        """Yield (global position, sample dict) for the rest of the current epoch."""
        order = epoch_order(self.sizes, self.seed, self.state.epoch)
        positions = rank_positions(len(order), self.state.position, self.rank, self.world_size)
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def produce():
            shards = {}
            try:
                for pos in positions:
                    if stop.is_set():
                        return
                    name, row = order[pos]
                    shard = shards.get(name) or shards.setdefault(name, self.reader.shard(name))
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
