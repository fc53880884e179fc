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

import hashlib
import json
import math
import os
import time
from pathlib import Path

from pipeline.data.conversations import index_rows, iter_rows, resolve_data
from pipeline.config import ExtractConfig
from pipeline.data.loss_mask import ConversationMasker, generation_prompt, render, template_message
from pipeline.data.shard_plan import assign_to_groups, parse_shards, shard_rows
from pipeline.errors import PipelineError
from pipeline.generate.assistant import parse_assistant
from pipeline.generate.parts import Parts
from pipeline.generate.turns import Turn, Written
from pipeline.provenance import sha256_file

TURNS = ("all", "last")
ROWS_PER_SHARD = 256   # the default shard count is ceil(rows / 256): the unit of resumption


class InProcess:
    """The target's transformers model in this process (pipeline/generate/sampling.py)."""

    def __init__(self, target_dir: Path, tokenizer, *, device: str, dtype: str, max_new_tokens: int, temperature: float,
                 top_p: float, batch_size: int):
        import torch

        from pipeline.speculative.live_target import LiveTarget
        from pipeline.target import load_model, read_target_facts
        from pipeline.devices import resolve_device

        device_, dtype_ = resolve_device(device, dtype)
        if device_.type == "cuda" and device_.index is None:   # under torchrun: this rank's GPU
            device_ = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        self.tokenizer = tokenizer
        self.target = LiveTarget(load_model(target_dir, dtype=dtype_).to(device_), [])
        self.stop = {i for i in (self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.eos_token_id)
                     if isinstance(i, int)}
        self.max_new, self.temperature, self.top_p, self.batch_size = max_new_tokens, temperature, top_p, batch_size
        self.device = f"{device_} ({str(dtype_).removeprefix('torch.')})"
        self.identity = {"backend": "in-process", "target": _target_name(target_dir),
                         "target_config_sha256": read_target_facts(target_dir).config_sha256}
        self._supplied: dict[str, str] = {}

    def supplied(self, kwargs: dict | None) -> str:
        key = json.dumps(kwargs or {}, sort_keys=True)
        if key not in self._supplied:
            self._supplied[key] = generation_prompt(self.tokenizer, kwargs or {}).supplied
        return self._supplied[key]

    def write(self, turns: list[Turn], wheres: list[str]) -> list[Written]:
        from pipeline.generate.sampling import generate

        out: list[Written] = []
        for first in range(0, len(turns), self.batch_size):
            chunk = turns[first:first + self.batch_size]
            prompts = [self.tokenizer(self._prompt(t, where), add_special_tokens=False)["input_ids"]
                       for t, where in zip(chunk, wheres[first:first + self.batch_size])]
            generated = generate(self.target, prompts, max_new=self.max_new, stop=self.stop,
                                 temperature=self.temperature, top_p=self.top_p, seeds=[t.seed for t in chunk])
            for turn, g in zip(chunk, generated):
                if not g.finished:
                    out.append(Written(None, len(g.tokens)))
                    continue
                parsed = parse_assistant(self.tokenizer.decode(g.tokens), self.supplied(turn.template_kwargs))
                out.append(Written(parsed.message, len(g.tokens), parsed.problem))
        return out


    def _prompt(self, turn: Turn, where: str) -> str:
        """The turn's prompt text. The validating pass rendered every prompt of the data; a turn
        after regenerated ones can still differ (other tool calls), so a refusal here is one line too."""
        try:
            return render(self.tokenizer, turn.messages, generation_prompt=True, tools=turn.tools,
                          template_kwargs=turn.template_kwargs)
        except Exception as e:  # noqa: BLE001 - templates raise many types
            raise PipelineError(f"{where}: the chat template cannot render the prompt for this turn "
                                f"({template_message(e)})") from None


def _target_name(target_dir: Path) -> str:
    """How generated_by names the target: `embedded`, or the directory as given. The config digest
    beside it is the identity; the name must not depend on where the tool is installed (the
    output and the resume plan would differ between installs)."""
    from pipeline.embedded import TARGET_DIR

    return "embedded" if Path(target_dir).resolve() == Path(TARGET_DIR).resolve() else str(target_dir)


def turn_seed(seed: int, sample_id: int, turn: int) -> int:
    """A sequence's own seed: its tokens never depend on the batch it shares."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}:{turn}".encode()).digest()[:8], "little") >> 1


def regenerate_rows(rows, backend, *, turns: str, seed: int, generated_by: dict) -> tuple[list[dict], dict]:
    """The shard's output rows and its counts."""
    convs = [list(r.messages) for r in rows]
    where = [[i for i, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
    if turns == "last":
        where = [w[-1:] for w in where]
    alive = [True] * len(rows)
    counts = {"rows": len(rows), "turns_written": 0, "dropped_unfinished": 0, "kept_verbatim": 0, "tokens": 0}
    problems: dict[str, int] = {}
    for t in range(max((len(w) for w in where), default=0)):
        pending = [k for k in range(len(rows)) if alive[k] and t < len(where[k])]
        written = backend.write([Turn(convs[k][:where[k][t]], rows[k].tools, rows[k].template_kwargs,
                                      turn_seed(seed, rows[k].sample_id, t)) for k in pending],
                                [f"{rows[k].where} (assistant turn {t + 1})" for k in pending])
        for k, w in zip(pending, written):
            counts["tokens"] += w.tokens
            if w.message is None:
                alive[k] = False
                counts["dropped_unfinished"] += 1
                continue
            convs[k][where[k][t]] = w.message
            counts["turns_written"] += 1
            if w.problem:
                counts["kept_verbatim"] += 1
                problems[w.problem] = problems.get(w.problem, 0) + 1
    out = []
    for row, conv, ok in zip(rows, convs, alive):
        if not ok:
            continue
        item = {**({"id": row.row_id} if row.row_id is not None else {}), "messages": conv}
        if row.tools:
            item["tools"] = row.tools
        if row.template_kwargs:
            item["chat_template_kwargs"] = row.template_kwargs
        item["generated_by"] = generated_by
        out.append(item)
    return out, {**counts, "verbatim_reasons": problems}


def _row_check(tokenizer, turns: str):
    """What a row must pass before generation: a conversation (not pre-tokenized) and, with the
    target's tokenizer, extract's own check plus a renderable prompt for every turn to write."""
    masker = ConversationMasker(tokenizer, ExtractConfig.end_of_turn, reasoning="keep") if tokenizer is not None else None

    def check(row) -> None:
        if row.messages is None:
            raise PipelineError(f"{row.where}: a pre-tokenized row (input_ids) has no conversation to regenerate")
        if masker is not None:
            masker.validate(row, prompts=turns)
    return check


def run_generate(*, data: list[str], out: Path, target: str | None = None, server: str | None = None,
                 model: str | None = None, concurrency: int = 8, shards: str | None = None,
                 num_shards: int | None = None, turns: str = "all", max_new_tokens: int = 512,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, batch_size: int = 16,
                 device: str = "auto", dtype: str = "auto", on_error: str = "fail", progress=None, on_total=None,
                 warn=None) -> dict:
    from pipeline.target import load_tokenizer, resolve_target

    if turns not in TURNS:
        raise PipelineError(f"--turns must be one of {', '.join(TURNS)}, got {turns!r}")
    for ok, message in ((max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {max_new_tokens}"),
                        (temperature >= 0, f"--temperature must be >= 0, got {temperature}"),
                        (0 < top_p <= 1, f"--top-p must be in (0, 1], got {top_p}"),
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
    index, _ = index_rows(paths, on_error, _row_check(tokenizer, turns), skipped)
    if warn and int(os.environ.get("RANK", 0)) == 0:
        for _, message in skipped:
            warn(f"skipped {message}")
    skip_ids = {sid for sid, _ in skipped}
    num_rows = sum(index.counts)
    if num_rows == 0:
        raise PipelineError(f"{', '.join(map(str, paths))}: the dataset has no rows")
    num_shards = num_shards or math.ceil(num_rows / ROWS_PER_SHARD)
    sampling = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, "seed": seed, "turns": turns}
    if server is not None:
        from pipeline.generate.server import Server

        backend = Server(server, model, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                         concurrency=concurrency, tokenizer=tokenizer)
    else:
        backend = InProcess(target_dir, tokenizer, device=device, dtype=dtype,
                            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, batch_size=batch_size)
    generated_by = {**backend.identity, "sampling": sampling}
    parts = Parts(out)
    parts.start({"data": [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in paths],
                 "num_rows": num_rows, "num_shards": num_shards, "generated_by": generated_by})

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    selected = parse_shards(shards, num_shards)
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
