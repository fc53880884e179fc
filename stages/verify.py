"""`pipeline verify-cache`: prove a cache is complete, intact, aligned and correctly masked.

Model-free checks (pipeline/cache/checks.py) read the cache in bounded windows. With a target
(`--target`, or the manifest's recorded one) this also re-runs `--recompute N` random samples and
compares every stored tap with hidden_states[j] for every j (catching off-by-one and swapped
taps), argmax and top-k, and re-derives loss masks from the recorded chat template.
"""

from __future__ import annotations

import hashlib
import random
import resource
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.cache.checks import (
    Check,
    check_alignment,
    check_chunks,
    check_digests,
    check_provenance,
    check_structure,
    open_cache,
    sound_shards,
)
from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import shard_name
from pipeline.data.conversations import iter_rows
from pipeline.data.loss_mask import ConversationMasker, token_kinds
from pipeline.data.shard_plan import parse_shards
from pipeline.errors import PipelineError
from pipeline.provenance import KernelCallCounter, kernel_record, sha256_file, tokenizer_digest
from pipeline.target import load_model, load_tokenizer, read_target_facts
from pipeline.ui import ProgressBar


def select_shards(reader: CacheReader, spec: str | None) -> list[str]:
    if spec is None:
        return reader.shards
    wanted = {shard_name(i) for i in parse_shards(spec, reader.manifest["config"]["num_shards"])}
    return [s for s in reader.shards if s in wanted]


def pick_samples(reader: CacheReader, shards: list[str], n: int, seed: int) -> list[tuple[str, int]]:
    """n distinct (shard, row) pairs drawn uniformly without replacement (all of them when n >= total)."""
    counts = [reader.manifest["shards"][name]["samples"] for name in shards]
    starts = np.cumsum([0] + counts)
    total = int(starts[-1])
    drawn = range(total) if n >= total else random.Random(seed).sample(range(total), n)
    picks = []
    for index in drawn:
        k = int(np.searchsorted(starts, index, side="right")) - 1
        picks.append((shards[k], int(index - starts[k])))
    return sorted(picks)


def resolve_recorded_target(reader: CacheReader, target: Path | None) -> Path | None:
    if target is not None:
        return target
    recorded = reader.manifest.get("sources", {}).get("target")
    return Path(recorded) if recorded and Path(recorded).is_dir() else None


def check_target_identity(reader: CacheReader, target_dir: Path, tokenizer) -> Check:
    facts = read_target_facts(target_dir)
    config = reader.manifest["config"]
    template = hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()
    problems = []
    if facts.config_sha256 != config["target"]["config_sha256"]:
        problems.append("config.json differs from the one the cache was made with")
    if tokenizer_digest(target_dir) != config["tokenizer"]["files_sha256"]:
        problems.append("tokenizer files differ")
    if template != config["tokenizer"]["chat_template_sha256"]:
        problems.append("chat template differs")
    cap = config["capture"]
    if (facts.hidden_size, facts.vocab_size, facts.num_hidden_layers) != (cap["hidden_size"], cap["vocab_size"], cap["num_hidden_layers"]):
        problems.append("hidden size, vocab or layer count differs")
    return Check("target_identity", not problems, f"{target_dir}: " + ("; ".join(problems) if problems else "config, tokenizer and chat template match the manifest"),
                 {"problems": problems})


@torch.no_grad()
def check_recompute(reader: CacheReader, picks, model, tol: float) -> Check:
    """Every stored tap against every hidden_states[j]: the best j must be tap + 1."""
    taps = reader.manifest["config"]["capture"]["target_layer_ids"]
    worst = {"max_abs": 0.0, "max_rel": 0.0}
    best_index: dict[int, dict[int, int]] = {t: {} for t in taps}
    argmax_same = topk_same = positions = 0
    best_shift: dict[int, int] = {}
    counter = KernelCallCounter(model)
    for name, row in picks:
        shard = reader.shard(name)
        sid = int(shard.sample_ids[row])
        sample = shard.sample(sid)
        ids = torch.from_numpy(sample["input_ids"].astype(np.int64))[None]
        with counter:
            out = model(input_ids=ids, output_hidden_states=True)
        states = torch.stack([h[0].float() for h in out.hidden_states])       # [L+1, T, H]
        stored = sample["hidden"].float()                                      # [T, n_taps, H]
        for k, tap in enumerate(taps):
            err = (states - stored[:, k][None]).abs().amax(dim=(1, 2))         # per hidden_states index
            j = int(err.argmin())
            best_index[tap][j] = best_index[tap].get(j, 0) + 1
            ref = states[tap + 1]
            shift_err = {d: float((stored[max(d, 0):len(stored) + min(d, 0), k] - ref[max(-d, 0):len(ref) - max(d, 0)]).abs().max())
                         for d in (-1, 0, 1)}
            d_best = min(shift_err, key=shift_err.get)
            best_shift[d_best] = best_shift.get(d_best, 0) + 1
            abs_err = float((stored[:, k] - ref).abs().max())
            worst["max_abs"] = max(worst["max_abs"], abs_err)
            worst["max_rel"] = max(worst["max_rel"], abs_err / max(float(ref.abs().max()), 1e-6))
        logits = out.logits[0].float()
        argmax_same += int((logits.argmax(-1).numpy() == sample["target_argmax"]).sum())
        k_top = sample["target_topk_ids"].shape[1]
        topk_same += int((torch.topk(logits, k_top).indices.numpy() == sample["target_topk_ids"]).all(axis=1).sum())
        positions += ids.shape[1]
    now = kernel_record(model, counter.counts)["path"]
    recorded = sorted({reader.manifest["shards"][n].get("kernels", {}).get("path") for n, _ in picks})
    aligned = all(list(best) == [t + 1] for t, best in best_index.items())
    in_place = list(best_shift) == [0]
    passed = aligned and in_place and worst["max_rel"] <= tol and argmax_same >= 0.99 * positions
    if not in_place:
        d = max((d for d in best_shift if d), key=best_shift.get)
        summary = f"hidden states shifted by {d:+d} position (stored[t] matches hidden_states[t{-d:+d}])"
    elif aligned:
        summary = f"{len(picks)} samples: every tap best matches hidden_states[tap+1]"
    else:
        summary = "taps match the wrong layers: " + ", ".join(f"tap {t} -> hidden_states{sorted(b)}" for t, b in best_index.items()
                                                             if list(b) != [t + 1])
    summary += (f"; max abs err {worst['max_abs']:.3g}, rel {worst['max_rel']:.3g} (tolerance {tol}); "
                f"argmax agree {argmax_same / max(positions, 1):.4f}, top-k agree {topk_same / max(positions, 1):.4f}; "
                f"kernels now {now}, recorded {'/'.join(map(str, recorded))}")
    if now not in recorded:
        summary += f" (drift between kernel paths: max rel err {worst['max_rel']:.3g})"
    return Check("recompute", passed, summary, {
        "best_hidden_state_index": {str(t): {str(j): c for j, c in b.items()} for t, b in best_index.items()},
        "best_position_shift": {str(d): c for d, c in best_shift.items()},
        **worst, "argmax_agreement": argmax_same / max(positions, 1), "topk_agreement": topk_same / max(positions, 1),
        "kernel_path_now": now, "kernel_path_recorded": recorded, "samples": len(picks)})


def check_loss_masks(reader: CacheReader, picks, tokenizer) -> Check:
    """Re-derive each picked sample from the dataset the manifest names and its chat template."""
    sources = reader.manifest.get("sources", {}).get("data", [])
    files = reader.manifest["config"]["data"]["files"]
    paths = [Path(p) for p in sources]
    if not paths or not all(p.is_file() for p in paths):
        return Check("loss_mask", True, "skipped: the dataset the manifest names is not readable here", skipped=True)
    if [sha256_file(p) for p in paths] != [f["sha256"] for f in files]:
        return Check("loss_mask", False, "the dataset files differ from the ones the cache was made with (sha256)")
    tok_cfg = reader.manifest["config"]["tokenizer"]
    cap = reader.manifest["config"]["capture"]
    wanted = {}
    for name, row in picks:
        shard = reader.shard(name)
        wanted[int(shard.sample_ids[row])] = shard
    rows = {r.sample_id: r for r in iter_rows(paths, on_error="skip", wanted=set(wanted)) if not isinstance(r, PipelineError)}
    # The same rule extract applied, in the mode and with the reasoning policy the manifest records.
    masker = ConversationMasker(tokenizer, tok_cfg["end_of_turn"], tok_cfg["chat_template_kwargs"],
                                tok_cfg.get("reasoning", "error"))
    mismatched, spans = [], {}
    for sid, shard in sorted(wanted.items()):
        row = rows.get(sid)
        if row is None:
            mismatched.append(f"sample {sid}: row not readable in the dataset")
            continue
        if row.messages is not None:
            try:
                t = masker(row.messages, tools=row.tools, row_kwargs=row.template_kwargs, where=row.where)
            except PipelineError as e:
                mismatched.append(f"sample {sid}: cannot be re-derived ({e})")
                continue
            ids, mask = t.input_ids, t.loss_mask
        else:
            ids, mask = row.input_ids, row.loss_mask
        ids, mask = ids[:cap["max_length"]], mask[:cap["max_length"]]
        stored_ids, stored_mask = shard.read("input_ids", sid).tolist(), shard.read("loss_mask", sid).tolist()
        supervised = [i for i, m in enumerate(stored_mask) if m]
        spans[str(sid)] = {"first": supervised[0] if supervised else None, "last": supervised[-1] if supervised else None}
        if stored_ids != ids:
            mismatched.append(f"sample {sid} ({row.where}): input_ids differ from re-tokenization")
        elif stored_mask != mask:
            first = next(i for i, (a, b) in enumerate(zip(stored_mask, mask)) if a != b)
            mismatched.append(f"sample {sid} ({row.where}): loss_mask differs first at position {first}")
    return Check("loss_mask", not mismatched,
                 f"{len(wanted)} samples re-derived from the chat template" + (f": {len(mismatched)} differ" if mismatched else ": identical"),
                 {"mismatched": mismatched[:50], "supervised_span_per_sample": spans})


def check_mask_boundaries(reader: CacheReader, picks, tokenizer) -> Check:
    """The stored masks obey the rule (no dataset needed, only the tokenizer's chat tokens)."""
    from pipeline.data.loss_mask import mask_violations

    vocab = tokenizer.get_vocab()
    if "<|im_start|>" not in vocab:
        return Check("mask_boundaries", True, "skipped: the tokenizer has no <|im_start|> turn marker", skipped=True)
    end = reader.manifest["config"]["tokenizer"]["end_of_turn"]
    kinds: dict[str, list[str]] = {}
    for name, row in picks:
        shard = reader.shard(name)
        sid = int(shard.sample_ids[row])
        found = mask_violations(shard.read("input_ids", sid).tolist(), shard.read("loss_mask", sid).tolist(),
                                turn_start=vocab["<|im_start|>"], end_of_turn=vocab[end], decode=tokenizer.decode)
        for kind, pos in found.items():
            kinds.setdefault(kind, []).append(f"sample {sid} position {pos}")
    summary = (f"{len(picks)} samples: headers, system/user turns unsupervised; {end} supervised" if not kinds else
               "; ".join(f"{kind} ({len(where)} samples, e.g. {where[0]})" for kind, where in kinds.items()))
    return Check("mask_boundaries", not kinds, summary, {"violations": {k: v[:10] for k, v in kinds.items()}})


def run_verify(cache_dir: Path, *, shards: str | None = None, target: Path | None = None, recompute: int = 0,
               sample_rate: float = 1.0, seed: int = 0, num_mask_samples: int = 32, progress: bool = False) -> dict:
    start = time.perf_counter()
    if not 0.0 < sample_rate <= 1.0:
        raise PipelineError(f"--sample-rate must be in (0, 1], got {sample_rate}")
    if recompute < 0:
        raise PipelineError(f"--recompute must be >= 0, got {recompute}")
    try:
        reader = open_cache(cache_dir)
    except PipelineError as e:
        if not cache_dir.is_dir():
            raise
        return {"cache": str(cache_dir), "passed": False, "checks": [Check("manifest", False, str(e)).record()]}
    selected = select_shards(reader, shards)
    checks = [Check("manifest", True, f"schema {reader.manifest['schema_version']}, {len(reader.shards)} committed shards, "
                                      f"{len(selected)} selected")]
    checks.append(check_structure(reader, selected))
    checks.append(check_digests(reader, selected, sample_rate >= 1.0))
    with ProgressBar("verify chunks", "shards", total=len(selected), enabled=progress) as bar:
        checks.extend(check_chunks(reader, selected, sample_rate, seed, lambda: bar.advance(1)))
    checks.extend(check_alignment(reader, selected))
    checks.append(check_provenance(reader, selected))
    target_dir = resolve_recorded_target(reader, target)
    if recompute and target_dir is None:
        raise PipelineError("--recompute needs --target: the target recorded in the manifest is not readable here")
    # Content checks read samples; a shard whose declared shapes disagree with the manifest is
    # reported by the structure check above and not read further.
    present = [name for name, _ in sound_shards(reader, selected)]
    if target_dir is not None and present:
        tokenizer = load_tokenizer(target_dir)
        model = load_model(target_dir) if recompute else None
        checks.append(check_target_identity(reader, target_dir, tokenizer))
        mask_picks = pick_samples(reader, present, max(num_mask_samples, recompute), seed)
        checks.append(check_mask_boundaries(reader, mask_picks, tokenizer))
        checks.append(check_loss_masks(reader, mask_picks, tokenizer))
        if recompute:
            tol = 0.02 if reader.hidden_format == "bf16" else 0.1
            checks.append(check_recompute(reader, pick_samples(reader, present, recompute, seed + 1), model, tol))
    else:
        checks.append(Check("loss_mask", True, "skipped: no target to take the tokenizer and chat template from", skipped=True))
    seconds = time.perf_counter() - start
    tokens = sum(reader.manifest["shards"][s]["tokens"] for s in selected)
    return {"cache": str(cache_dir), "passed": all(c.passed for c in checks), "checks": [c.record() for c in checks],
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


SPAN_STYLES = {"reasoning": "bold black on yellow", "content": "bold black on green", "tool_call": "bold white on blue",
               "end_of_turn": "bold white on magenta", "": "dim"}


def show_sample(cache_dir: Path, sample_id: int, target: Path | None):
    """A rich Text of the decoded sample, supervised tokens coloured by kind (reasoning, content,
    tool call, end of turn), and its span summary."""
    from rich.text import Text

    reader = open_cache(cache_dir)
    shard = reader.find(sample_id)
    target_dir = resolve_recorded_target(reader, target)
    if target_dir is None:
        raise PipelineError("--show needs the target's tokenizer: pass --target")
    tokenizer = load_tokenizer(target_dir)
    ids, mask = shard.read("input_ids", sample_id).tolist(), shard.read("loss_mask", sample_id).tolist()
    pieces = [tokenizer.decode([token]) for token in ids]
    ends = np.cumsum([len(p) for p in pieces])
    offsets = np.stack([ends - [len(p) for p in pieces], ends], axis=1) if pieces else np.zeros((0, 2), dtype=np.int64)
    kinds = token_kinds("".join(pieces), offsets, mask, reader.manifest["config"]["tokenizer"]["end_of_turn"])
    text = Text()
    for piece, kind in zip(pieces, kinds):
        text.append(piece, style=SPAN_STYLES[kind])
    supervised = [i for i, m in enumerate(mask) if m]
    by_kind = ", ".join(f"{kinds.count(k)} {k.replace('_', ' ')}" for k in ("reasoning", "content", "tool_call", "end_of_turn"))
    legend = "  ".join(f"[{SPAN_STYLES[k]}] {k.replace('_', ' ')} [/]" for k in ("reasoning", "content", "tool_call", "end_of_turn"))
    header = (f"sample {sample_id} ({shard.path.name}): {len(ids)} tokens, {len(supervised)} supervised ({by_kind}), "
              f"first {supervised[0] if supervised else None}, last {supervised[-1] if supervised else None}")
    return header, text, legend
