"""`pipeline generate`: regenerate the training responses with the target itself (DESIGN 3.7).

Rows are read as extract reads them (OpenAI `messages` or ShareGPT `conversations`; one-line
errors naming the file and line). Each assistant turn is regenerated in order, the later ones
conditioned on the regenerated earlier ones (`turns="all"`), or only the last (`"last"`); the
prompt of a turn is the conversation before it, rendered with the target's chat template and its
generation prompt (the row's tools and chat_template_kwargs included). The new turn is split
into `reasoning_content`, `content` and `tool_calls` (pipeline/generate/assistant.py). A row
whose turn does not end within `max_new_tokens` is dropped and counted, never truncated.
Backends: the target in this process (`InProcess`, batched) or an OpenAI-compatible server
(pipeline/generate/server.py, concurrent requests).

Shards follow extract's plan (shard s holds rows [s*N/S, (s+1)*N/S)); under torchrun each rank
takes every WORLD_SIZE-th selected shard. A shard's rows are batched the same way whoever runs
it, so 1 process and N processes write the same bytes. Output: pipeline/generate/parts.py.
"""

from __future__ import annotations

import math
import time

from pipeline.data.conversations import index_rows, iter_rows, resolve_data
from pipeline.cache.shard_plan import assign_to_groups, parse_shards, shard_rows
from pipeline.distributed import launched_rank, launched_world_size
from pipeline.errors import PipelineError
from pipeline.generate.in_process import InProcess
from pipeline.generate.parts import Parts
from pipeline.generate.regenerate import regenerate_rows, row_check
from pipeline.generate.server import Server
from pipeline.provenance import file_records
from pipeline.sampler import check_sampling
from pipeline.target_model import load_tokenizer, resolve_target
from stages.generate.options import GenerateOptions

TURNS = ("all", "last")
ROWS_PER_SHARD = 256   # the default shard count is ceil(rows / 256): the unit of resumption


def run_generate(options: GenerateOptions, *, progress=None, on_total=None, warn=None) -> dict:
    """Regenerate the rows' assistant turns; `progress(rows, tokens=)` per shard, `on_total(rows)`
    once the shards to write are known."""
    o = options
    data, out, target, server, turns, seed = o.data, o.out, o.target, o.server, o.turns, o.seed
    max_new_tokens, temperature, top_p, batch_size = o.max_new_tokens, o.temperature, o.top_p, o.batch_size
    concurrency, num_shards, on_error = o.concurrency, o.num_shards, o.on_error
    if turns not in TURNS:
        raise PipelineError(f"--turns must be one of {', '.join(TURNS)}, got {turns!r}")
    check_sampling(temperature, top_p)   # the sampler's rule, before any model is loaded
    for ok, message in ((max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {max_new_tokens}"),
                        (batch_size >= 1, f"--batch-size must be >= 1, got {batch_size}"),
                        (concurrency >= 1, f"--concurrency must be >= 1, got {concurrency}"),
                        (server is None or server.startswith(("http://", "https://")),
                         f"--server must be an http(s) URL, got {server!r}"),
                        (num_shards is None or num_shards >= 1, f"--num-shards must be >= 1, got {num_shards}"),
                        (on_error in ("fail", "skip"), f"--on-error must be 'fail' or 'skip', got {on_error!r}")):
        if not ok:
            raise PipelineError(message)
    paths = resolve_data(data)
    target_dir = resolve_target(target or "embedded") if server is None or target else None
    tokenizer = load_tokenizer(target_dir) if target_dir is not None else None
    skipped: list[tuple[int, str]] = []
    # Extract's validating pass (pipeline/data/loss_mask.py ConversationMasker.validate), plus each
    # turn's prompt; with on_error='fail' the first bad row stops here, before any generation.
    index, _ = index_rows(paths, on_error, row_check(tokenizer, turns), skipped)
    rank, world = launched_rank(), launched_world_size()
    if warn and rank == 0:
        for _, message in skipped:
            warn(f"skipped {message}")
    skip_ids = {sid for sid, _ in skipped}
    num_rows = sum(index.counts)
    if num_rows == 0:
        raise PipelineError(f"{', '.join(map(str, paths))}: the dataset has no rows")
    num_shards = num_shards or math.ceil(num_rows / ROWS_PER_SHARD)
    sampling = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, "seed": seed, "turns": turns}
    if server is not None:
        backend = Server(server, o.model, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                         concurrency=concurrency, tokenizer=tokenizer)
    else:
        backend = InProcess(target_dir, tokenizer, device=o.device, dtype=o.dtype,
                            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, batch_size=batch_size)
    generated_by = {**backend.identity, "sampling": sampling}
    parts = Parts(out)
    parts.start({"data": file_records(paths),
                 "num_rows": num_rows, "num_shards": num_shards, "generated_by": generated_by})

    selected = parse_shards(o.shards, num_shards)
    mine = assign_to_groups(selected, world, rank)
    finished = parts.complete()     # a re-run of a finished output does nothing
    todo = [] if finished else [s for s in mine if parts.done(s) is None]
    if on_total:
        on_total(sum(len(shard_rows(s, num_rows, num_shards)) for s in todo))
    totals = {"rows": 0, "rows_written": 0, "rows_skipped": 0, "turns_written": 0, "dropped_unfinished": 0,
              "kept_verbatim": 0, "tokens": 0}
    started = time.perf_counter()
    for shard in todo:
        wanted = shard_rows(shard, num_rows, num_shards)
        rows = [row for row in iter_rows(paths, wanted=wanted, index=index, on_error=on_error)
                if not isinstance(row, PipelineError) and row.sample_id not in skip_ids]
        t0 = time.perf_counter()
        written, counts = regenerate_rows(rows, backend, turns=turns, seed=seed, generated_by=generated_by)
        counts["rows_skipped"] = len(wanted) - len(rows)
        record = parts.write(shard, written, {**counts, "seconds": time.perf_counter() - t0})
        for key in totals:
            totals[key] += record.get(key, 0)
        if progress:
            progress(len(rows), tokens=counts["tokens"])
    seconds = time.perf_counter() - started
    assembled = finished or parts.assemble(num_shards)   # `finished` has hashed the output already
    missing = [] if assembled else [s for s in range(num_shards) if parts.done(s) is None]
    return {"out": str(out), "assembled": assembled, "num_rows": num_rows, "num_shards": num_shards,
            "shards_written": len(todo), "shards_already_done": len(mine) - len(todo), "shards_missing": missing[:20],
            "rank": rank, "world_size": world, "device": backend.device, "generated_by": generated_by, **totals,
            "skipped": [message for _, message in skipped[:20]],
            "parts": (f"{parts.dir} keeps plan.json and complete.json only (the shards are in the output; a re-run "
                      "recognises it)") if assembled else f"{parts.dir} holds the finished shards until all are done",
            "server_retries": getattr(backend, "failures", 0),
            "seconds": seconds, "rows_per_s": totals["rows"] / max(seconds, 1e-9),
            "tokens_per_s": totals["tokens"] / max(seconds, 1e-9)}
