"""Stage one, `pipeline extract`: run the target once and write the hidden-state cache.

The cache is a directory or an object-store prefix (pipeline/cache/location.py). The manifest is
created once (if absent; a later invocation must match its identity). Per selected shard: skip
it if its commit record is there, take its lock in a directory (skip it if another process
holds it), else read and tokenize its rows, run the target over length-sorted batches, hand the
results to a background writer (compression + storage off the forward path), and commit the
shard by writing its record last (DESIGN 11: no rename, no lock needed for correctness). Cost: one target forward per token,
plus the logits top-k/logsumexp in token chunks.
"""

from __future__ import annotations

import platform
import re
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from pipeline.cache.encoding import encode_rows
from pipeline.cache.commit import shard_committed
from pipeline.cache.files import FileLock
from pipeline.cache.location import LocalLocation, Location, open_location
from pipeline.cache.manifest import Identity, SourcesRecord, create_manifest, new_manifest, parse_identity
from pipeline.cache.schema import MANIFEST, SCHEMA_VERSION, Chunking, shard_lock_name, shard_name
from pipeline.cache.writer import AlreadyCommitted, BackgroundWriter, ShardWriter
from pipeline.capture import Capture
from pipeline.config import EMBEDDED, ExtractConfig
from pipeline.data.conversations import index_rows, iter_rows, resolve_data
from pipeline.data.loss_mask import REASONING, TOOL_CALL, ConversationMasker, GenerationPrompt
from pipeline.data.shard_plan import assign_to_groups, parse_shards, shard_rows
from pipeline.distributed import Layout, init_layout
from pipeline.errors import PipelineError
from pipeline.faults import failpoint
from pipeline.provenance import (
    environment,
    kernel_record,
    sha256_file,
    tokenizer_digest,
    weight_digests,
)
from pipeline.taps import TAP_CONVENTION, default_taps, validate_taps
from pipeline.transformers_internals import KernelCallCounter
from pipeline.target import (
    chat_template_sha256,
    load_model,
    load_tokenizer,
    read_target_facts,
    reserved_token_ids,
    resolve_target,
)
from pipeline.ui import ProgressBar


def default_layers(target: str, num_layers: int) -> list[int]:
    if target == EMBEDDED:
        from manifests import load_preset
        return list(load_preset("tiny")["target"]["target_layer_ids"])
    return default_taps(num_layers, 5)


def load_target_model(target_dir: Path, dtype: torch.dtype, device: torch.device, layout: Layout, num_kv_heads: int):
    """(model, tensor-parallel plan description or None)."""
    kwargs, plan = {}, None
    if layout.tp > 1:
        from pipeline.tensor_parallel import tp_load_kwargs
        kwargs, plan = tp_load_kwargs(layout, num_kv_heads)
    model = load_model(target_dir, dtype=dtype, **kwargs)
    if layout.tp == 1:
        model = model.to(device)
    return model, plan


def scan_dataset(paths: list[Path], on_error: str, masker: ConversationMasker) -> dict:
    """One validating pass over the dataset: row count, malformed rows (fail fast before any GPU
    work and before the manifest is written: every conversation is rendered with the chat
    template, ~0.03-0.3 ms a row), where each row starts (so each shard reads only its rows) and
    file digests, so the shard plan and the manifest's data identity are known up front."""
    index, malformed = index_rows(paths, on_error, masker.validate)
    num_rows = sum(index.counts)
    if num_rows == 0:
        raise PipelineError(f"{', '.join(map(str, paths))}: the dataset has no rows")
    files = [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in paths]
    return {"num_rows": num_rows, "malformed_rows": malformed, "files": files, "index": index}


def identity_record(cfg: ExtractConfig, *, facts, tokenizer, prompt: GenerationPrompt, target_dir: Path, taps: list[int], dataset: dict,
                    compute_dtype: str) -> Identity:
    """Everything that decides the cache's content; a later invocation must match it exactly."""
    return parse_identity({
        "num_shards": cfg.num_shards,
        "target": {"model_type": facts.model_type, "config_sha256": facts.config_sha256,
                   "num_hidden_layers": facts.num_hidden_layers, "weights": weight_digests(target_dir)},
        "tokenizer": {"files_sha256": tokenizer_digest(target_dir),
                      "chat_template_sha256": chat_template_sha256(tokenizer),
                      "chat_template_kwargs": cfg.chat_template_kwargs,
                      "thinking": "on" if prompt.thinking else "off",
                      "generation_prompt": prompt.header + prompt.supplied,
                      "reasoning": cfg.reasoning,
                      "boundary_tokens": "supervised when any of their characters is generated",
                      "end_of_turn": cfg.end_of_turn},
        "data": {"num_rows": dataset["num_rows"], "files": dataset["files"], "generated_by": cfg.generated_by},
        "capture": {"target_layer_ids": taps, "tap_convention": TAP_CONVENTION,
                    "num_hidden_layers": facts.num_hidden_layers, "hidden_size": facts.hidden_size,
                    "vocab_size": facts.vocab_size, "top_k": cfg.top_k, "hidden_format": cfg.hidden_format,
                    "stored_dtype": {"bf16": "bfloat16 bit pattern (uint16)", "fp8": "float8_e4m3fn (uint8) x float32 scale per token and tap"}[cfg.hidden_format],
                    "compute_dtype": compute_dtype, "max_length": cfg.max_length, "overlong": cfg.overlong,
                    "on_error": cfg.on_error, "zstd_level": cfg.zstd_level, "checksum": "crc32c per inner chunk",
                    "storage": chunking(cfg).record()},
    })


def chunking(cfg: ExtractConfig) -> Chunking:
    try:
        return Chunking.from_options(cfg.chunking)
    except (TypeError, ValueError) as e:
        raise PipelineError(f"chunking: {e}") from None


def cache_dims(cfg: ExtractConfig, facts, taps: list[int]) -> dict[str, int]:
    return {"n_taps": len(taps), "hidden_size": facts.hidden_size, "top_k": cfg.top_k}


# Per-shard counts of what the rows carried and what got supervised (summed over shards in the summary).
CONTENT_COUNTS = ("rows_with_reasoning", "rows_with_tool_calls", "rows_with_tool_replies", "reasoning_turns_dropped",
                  "reasoning_turns_not_rendered", "supervised_tokens", "reasoning_tokens", "tool_call_tokens")
ROW_COUNTS = ("malformed", "no_supervised_tokens", "overlong_skipped", "truncated")


def prepare_samples(cfg: ExtractConfig, paths: list[Path], rows: range, masker: ConversationMasker, vocab_size: int,
                    index=None) -> tuple[list, dict]:
    """(samples [(sample_id, input_ids, loss_mask)], counts) for one shard's rows."""
    counts = {"rows": len(rows), **dict.fromkeys(ROW_COUNTS + CONTENT_COUNTS, 0), "generated_by": {}}

    def refuse(message: str) -> None:
        if cfg.on_error != "skip":
            raise PipelineError(message)
        counts["malformed"] += 1

    samples = []
    for item in iter_rows(paths, on_error=cfg.on_error, wanted=rows, index=index):
        if isinstance(item, PipelineError):
            counts["malformed"] += 1
            continue
        tok = None
        if item.messages is not None:
            try:
                tok = masker(item.messages, tools=item.tools, row_kwargs=item.template_kwargs, where=item.where)
            except PipelineError as e:
                refuse(str(e))
                continue
            ids, mask = tok.input_ids, tok.loss_mask
        else:
            ids, mask = item.input_ids, item.loss_mask
            if max(ids, default=0) >= vocab_size:
                refuse(f"{item.where}: field 'input_ids' has id {max(ids)} >= vocab_size {vocab_size}")
                continue
        if len(ids) > cfg.max_length:
            if cfg.overlong == "error":
                raise PipelineError(f"{item.where}: {len(ids)} tokens, over max_length {cfg.max_length} "
                                    "(--overlong truncate or skip to accept such rows)")
            if cfg.overlong == "skip":
                counts["overlong_skipped"] += 1
                continue
            ids, mask = ids[:cfg.max_length], mask[:cfg.max_length]
            counts["truncated"] += 1
        if not any(mask):
            counts["no_supervised_tokens"] += 1
            continue
        if tok is not None:
            counts["rows_with_reasoning"] += bool(tok.stats["reasoning_turns"])
            counts["rows_with_tool_calls"] += bool(tok.stats["tool_call_turns"])
            counts["rows_with_tool_replies"] += bool(tok.stats["tool_replies"])
            counts["reasoning_turns_dropped"] += tok.stats["reasoning_turns_dropped"]
            counts["reasoning_turns_not_rendered"] += tok.stats["reasoning_turns_not_rendered"]
            kept = tok.kinds[:len(ids)]  # a truncated row counts only the tokens it keeps
            counts["reasoning_tokens"] += kept.count(REASONING)
            counts["tool_call_tokens"] += kept.count(TOOL_CALL)
        counts["supervised_tokens"] += sum(mask)
        source = item.generated_by or cfg.generated_by or "unknown"
        counts["generated_by"][source] = counts["generated_by"].get(source, 0) + 1
        samples.append((item.sample_id, ids, mask))
    counts["reasoning_share"] = counts["reasoning_tokens"] / counts["supervised_tokens"] if counts["supervised_tokens"] else None
    counts["special_ids"] = special_ids_seen(masker.tokenizer, samples)
    return samples, counts


def special_ids_seen(tokenizer, samples: list) -> list[int]:
    """Which reserved ids (special or added tokens, or past the tokenizer's vocabulary) occur in
    the shard's input_ids: train checks its mask id against this instead of reading every token."""
    if not samples:
        return []
    present = np.unique(np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids, _ in samples]))
    reserved = reserved_token_ids(tokenizer)
    return [int(i) for i in present if int(i) in reserved or i >= len(tokenizer)]


def length_batches(samples: list, batch_tokens: int) -> list[list]:
    """Length-sorted batches whose padded size (count x longest) fits the token budget."""
    ordered = sorted(samples, key=lambda s: (len(s[1]), s[0]))
    batches, current = [], []
    for s in ordered:
        if current and (len(current) + 1) * len(s[1]) > batch_tokens:
            batches.append(current)
            current = []
        current.append(s)
    if current:
        batches.append(current)
    return batches


def run_extract(cfg: ExtractConfig, shards_spec: str | None, *, progress: bool = True) -> dict:
    start = time.perf_counter()
    layout = init_layout(cfg.tp)
    location = open_location(cfg.cache)
    if layout.is_writer:  # a bad location fails here, before any data is read or a model loaded
        location.ensure_root()
        refuse_foreign_content(location)
    target_dir = resolve_target(cfg.target)
    facts = read_target_facts(target_dir)
    taps = list(cfg.layers) if cfg.layers is not None else default_layers(cfg.target, facts.num_hidden_layers)
    validate_taps(taps, facts.num_hidden_layers)
    if cfg.top_k > facts.vocab_size:
        raise PipelineError(f"top_k {cfg.top_k} exceeds the target's vocab_size {facts.vocab_size}")
    selected = parse_shards(shards_spec, cfg.num_shards)
    paths = resolve_data(cfg.data)
    if cfg.generated_by is None and all(d.startswith("embedded:") for d in cfg.data):
        from dataclasses import replace
        cfg = replace(cfg, generated_by="the embedded target itself, greedy (pipeline/toy/generate.py)")
    tokenizer = load_tokenizer(target_dir)
    # One masker (one probe of the generation prompt) for the validating pass and every shard.
    masker = ConversationMasker(tokenizer, cfg.end_of_turn, cfg.chat_template_kwargs, cfg.reasoning)
    dataset = scan_dataset(paths, cfg.on_error, masker)

    use_cuda = torch.cuda.is_available()
    compute = cfg.compute_dtype if cfg.compute_dtype != "auto" else ("bfloat16" if use_cuda else "float32")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    model, tp_plan = load_target_model(target_dir, getattr(torch, compute), device, layout,
                                                  facts.num_key_value_heads)
    identity = identity_record(cfg, facts=facts, tokenizer=tokenizer, prompt=masker.prompt(cfg.chat_template_kwargs),
                               target_dir=target_dir, taps=taps,
                               dataset=dataset, compute_dtype=compute)
    plan = {"assignment": "contiguous: shard s holds rows [s*N//S, (s+1)*N//S)", "num_rows": dataset["num_rows"],
            "num_shards": cfg.num_shards,
            "storage": chunking(cfg).geometry(cfg.hidden_format, cache_dims(cfg, facts, taps))}
    if layout.is_writer:
        manifest, created = create_manifest(location, new_manifest(
            identity=identity, provenance=environment(), plan=plan, resolved_config=asdict(cfg),
            sources=SourcesRecord(target=str(target_dir), data=[str(p) for p in paths])))
        conflicts = [] if created else [d.arrow() for d in manifest.identity.differences(identity.flat(), complete=True)]
        if conflicts:
            shown = "; ".join(conflicts[:4]) + (f"; and {len(conflicts) - 4} more" if len(conflicts) > 4 else "")
            raise PipelineError(f"{location.where()}: was created with a different configuration ({shown}); "
                                "use another --cache or the original settings")
    mine = assign_to_groups(selected, layout.dp, layout.dp_rank)
    run = _ShardRun(cfg=cfg, paths=paths, masker=masker, facts=facts, taps=taps, model=model, layout=layout,
                    location=location, tp_plan=tp_plan, identity=identity.shard_identity(), index=dataset["index"],
                    capture=Capture(model, taps, top_k=cfg.top_k, pad_id=tokenizer.pad_token_id or 0))
    skipped = {"committed": 0, "locked": 0}
    locks = cfg.shard_locks and isinstance(location, LocalLocation)
    bar = ProgressBar("extract", "samples", enabled=progress and layout.rank == 0,
                      total=sum(len(shard_rows(s, dataset["num_rows"], cfg.num_shards)) for s in mine))
    stream_start = time.perf_counter()
    with bar:
        try:
            for shard in mine:
                rows = shard_rows(shard, dataset["num_rows"], cfg.num_shards)
                state, lock = _claim(location, shard, layout, locks)
                if state != "write":
                    skipped[state] += 1
                    bar.advance(len(rows))
                    continue
                run.process(shard, rows, lock, bar)
        finally:
            run.close()
    stream_seconds = time.perf_counter() - stream_start
    seconds = time.perf_counter() - start
    totals = {"shards_written": len(run.records),
              "shards_already_committed": skipped["committed"] + run.committed_elsewhere,
              "shards_locked_elsewhere": skipped["locked"],
              "samples": sum(r["samples"] for r in run.records), "tokens": sum(r["tokens"] for r in run.records),
              "stored_bytes": sum(r["bytes"] for r in run.records)}
    for key in ROW_COUNTS + CONTENT_COUNTS:
        totals[key] = sum(r["counts"].get(key, 0) for r in run.records)
    totals["reasoning_share"] = totals["reasoning_tokens"] / totals["supervised_tokens"] if totals["supervised_tokens"] else None
    totals["generated_by"] = {}
    for r in run.records:
        for source, n in r["counts"].get("generated_by", {}).items():
            totals["generated_by"][source] = totals["generated_by"].get(source, 0) + n
    raw_hidden = len(taps) * facts.hidden_size * 2
    tokens = max(totals["tokens"], 1)
    return {
        "cache": location.where(),
        "rank": layout.rank,
        "layout": layout.record(),
        "selected_shards": len(selected),
        "my_shards": len(mine),
        **totals,
        "bytes_per_token": totals["stored_bytes"] / tokens if totals["tokens"] else None,
        "raw_bf16_hidden_bytes_per_token": raw_hidden,
        "compression_vs_raw_bf16_hidden": raw_hidden * tokens / totals["stored_bytes"] if totals["stored_bytes"] else None,
        "seconds": seconds,
        "setup_seconds": seconds - stream_seconds,
        "tokens_per_s": totals["tokens"] / seconds,
        "stream_tokens_per_s": totals["tokens"] / stream_seconds,
        "writer": "inline" if run.writer_queue == 0 else f"background thread, queue {run.writer_queue}",
    }


def refuse_foreign_content(location: Location) -> None:
    """A location without a manifest must be empty (or hold only this tool's lock files): a
    prefix or directory that holds something else is never written into."""
    if location.read(MANIFEST) is not None:
        return
    foreign = [k for k in location.some_keys(20) if not re.fullmatch(r"\.shard-\d{5}\.lock|\.manifest\.json\.tmp-\d+", k)]
    if foreign:
        raise PipelineError(f"{location.where()}: holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''} "
                            "but no cache manifest.json: not a cache; choose an empty --cache location")


def _claim(location: Location, shard: int, layout: Layout, locks: bool) -> tuple[str, FileLock | None]:
    """('write', held lock or None) | ('committed', None) | ('locked', None), decided by the group's
    writer. The lock only saves a second process the work (a directory where flock works): what
    keeps the cache correct is the commit record, checked before and after taking it."""
    state, lock = "write", None
    if layout.is_writer:
        name = shard_name(shard)
        if shard_committed(location, name):
            state = "committed"
        elif locks:
            lock = FileLock(location.root / shard_lock_name(shard))
            try:
                held = lock.acquire(blocking=False)
            except OSError:  # no working flock on this mount (ENOLCK, EOPNOTSUPP): go on without
                held, lock = True, None
            if not held:
                state, lock = "locked", None
            elif shard_committed(location, name):
                if lock is not None:
                    lock.release()  # another process finished it between our two looks
                state, lock = "committed", None
    return layout.broadcast_from_writer(state), lock


class _ShardRun:
    """Forward on this thread; encoding, compression, writing and the commit of each shard on one
    background thread, so shard k commits while shard k+1 runs through the target."""

    def __init__(self, *, cfg, paths, masker, facts, taps, model, layout, location, tp_plan, identity, capture, index):
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
            writer.attrs.update({"counts": counts, "identity": self.identity,
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
            self.records.append(writer.commit())
        except AlreadyCommitted:
            self.committed_elsewhere += 1
        finally:
            if lock is not None:
                lock.release()

    def close(self) -> None:
        if self.background is not None:
            self.background.close()
