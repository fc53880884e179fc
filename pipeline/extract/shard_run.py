"""Extracting shards: each shard's rows turned into samples, run through the target in
length-sorted batches on this thread, and encoded, compressed, written and committed on one
background thread, so shard k commits while shard k+1 runs through the target."""

from __future__ import annotations

import platform

import numpy as np
import torch

from pipeline.cache.encoding import encode_rows
from pipeline.extract.extract_record import cache_dims, chunking
from pipeline.files import FileLock
from pipeline.cache.identity import Identity
from pipeline.cache.manifest import identity_conflicts
from pipeline.cache.schema import MANIFEST, SCHEMA_VERSION, shard_name
from pipeline.cache.writer import AlreadyCommitted, BackgroundWriter, ShardWriter
from pipeline.data.samples import CONTENT_COUNTS, ROW_COUNTS, length_batches, prepare_samples
from pipeline.errors import PipelineError
from pipeline.faults import failpoint
from pipeline.provenance import environment
from pipeline.target_model.kernels import kernel_record
from pipeline.target_model.internals import KernelCallCounter


class ShardRun:
    """Forward on this thread; encoding, compression, writing and the commit of each shard on one
    background thread, so shard k commits while shard k+1 runs through the target."""

    def __init__(self, *, cfg, paths, masker, facts, taps, model, layout, location, tp_plan, identity: Identity,
                 capture, index):
        self.identity, self.index = identity, index
        self.cfg, self.paths, self.masker, self.facts, self.taps = cfg, paths, masker, facts, taps
        self.model, self.layout, self.location, self.tp_plan, self.capture = model, layout, location, tp_plan, capture
        self.committed_elsewhere = 0
        self.writer_queue = cfg.writer_queue if cfg.writer_queue is not None else (4 if torch.cuda.is_available() else 0)
        self.background = BackgroundWriter(depth=self.writer_queue) if layout.is_writer else None
        self.records: list[dict] = []

    def process(self, shard: int, rows: range, lock: FileLock | None, bar) -> None:
        cfg = self.cfg
        samples, counts = prepare_samples(cfg, self.paths, rows, self.masker, self.facts.vocab_size, self.index)
        if not samples:
            raise PipelineError(f"{shard_name(shard)}: none of its {len(rows)} rows yields a supervised sample "
                                f"({counts}); fix the data or use fewer shards")
        writer = None
        if self.layout.is_writer:
            writer = ShardWriter(self.location, shard, dims=cache_dims(cfg, self.facts, self.taps),
                                 hidden_format=cfg.hidden_format, zstd_level=cfg.zstd_level, chunking=chunking(cfg),
                                 attrs={"schema_version": SCHEMA_VERSION, "row_range": [rows.start, rows.stop]},
                                 num_tokens=sum(len(s[1]) for s in samples))
        counter = KernelCallCounter(self.model)
        for batch in length_batches(samples, cfg.batch_tokens):
            with counter:
                outs = self.capture([s[1] for s in batch])
            failpoint("extract.batch")
            if writer is not None:
                self.background.submit(lambda b=batch, o=outs: [
                    writer.append(sid, self._encode(ids, mask, out)) for (sid, ids, mask), out in zip(b, o)])
            bar.advance(len(batch), tokens=sum(len(s[1]) for s in batch))
        bar.advance(len(rows) - len(samples))
        if writer is not None:
            writer.attrs.update({"counts": counts, "identity": self.identity.shard_identity(),
                                 "kernels": kernel_record(self.model, counter.counts)})
            writer.run_record.update({"layout": {**self.layout.record(), "tp_plan": self.tp_plan},
                                      "host": platform.node(), "environment": environment()})
            self.background.submit(lambda: self._commit(writer, shard, lock))

    def _encode(self, ids, mask, out) -> dict[str, np.ndarray]:
        rows = encode_rows(self.cfg.hidden_format, ids, mask, out)
        failpoint("extract.encoded")
        return rows

    def _commit(self, writer: ShardWriter, shard: int, lock: FileLock | None) -> None:
        try:
            self._refuse_replaced_manifest(shard)
            self.records.append(writer.commit())
        except AlreadyCommitted:
            self.committed_elsewhere += 1
        finally:
            if lock is not None:
                lock.release()

    def _refuse_replaced_manifest(self, shard: int) -> None:
        """One read of manifest.json before each commit record: a shard is never committed under
        an identity the cache no longer has (a store that let another extract replace the manifest
        after this one read it back). The shard's files stay uncommitted: invisible to readers."""
        conflicts = identity_conflicts(self.location, self.identity)
        if conflicts:
            shown = "; ".join(d.arrow() for d in conflicts[:3])
            raise PipelineError(f"{self.location.where(MANIFEST)}: replaced by another extract with a different "
                                f"configuration ({shown}) while this one wrote {shard_name(shard)}; the shard was not "
                                "committed; the store does not honour create-if-absent writes")

    def close(self) -> None:
        if self.background is not None:
            self.background.close()

    def totals(self) -> dict:
        """The written shards' records summed: samples, tokens, bytes and the row and content counts."""
        totals = {"shards_written": len(self.records),
                  "samples": sum(r["samples"] for r in self.records), "tokens": sum(r["tokens"] for r in self.records),
                  "stored_bytes": sum(r["bytes"] for r in self.records)}
        for key in ROW_COUNTS + CONTENT_COUNTS:
            totals[key] = sum(r["counts"].get(key, 0) for r in self.records)
        totals["reasoning_share"] = (totals["reasoning_tokens"] / totals["supervised_tokens"]
                                     if totals["supervised_tokens"] else None)
        totals["generated_by"] = {}
        for r in self.records:
            for source, n in r["counts"].get("generated_by", {}).items():
                totals["generated_by"][source] = totals["generated_by"].get(source, 0) + n
        return totals
