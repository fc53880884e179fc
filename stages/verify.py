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

from pipeline.cache.encoding import decode_bf16, decode_fp8

from pipeline.cache.checks import (
    Check,
    SampleList,
    check_alignment,
    check_chunks,
    check_digests,
    check_provenance,
    check_structure,
    open_cache,
    WINDOW_TOKENS,
    sample_windows,
    sound_shards,
)
from pipeline.capture import tail_forward
from pipeline.cache.manifest import describe_missing, missing_shards
from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import shard_name
from pipeline.data.conversations import index_rows, iter_rows
from pipeline.data.loss_mask import ConversationMasker, mask_violations, newline_tokens, token_kinds
from pipeline.data.shard_plan import parse_shards
from pipeline.errors import PipelineError
from pipeline.provenance import KernelCallCounter, kernel_record, sha256_file, tokenizer_digest
from pipeline.target import load_model, load_tokenizer, read_target_facts
from pipeline.ui import ProgressBar


# How far a stored prediction may be from the tail recompute, in logits, by hidden format: the
# stored tap is rounded to bf16 (or fp8), so the recompute starts from a slightly different
# input. Measured on the embedded target (BENCHMARKS.md) with a wide margin; the faults verify
# must catch (a tap shifted by a position, taken from the layer before) are far above.
TAIL_TOLERANCE = {"bf16": {"argmax": 0.1, "topk": 0.25, "logsumexp": 0.15},
                  "fp8": {"argmax": 0.5, "topk": 1.5, "logsumexp": 0.6}}


def select_shards(reader: CacheReader, spec: str | None) -> list[str]:
    if spec is None:
        return reader.shards
    wanted = {shard_name(i) for i in parse_shards(spec, reader.manifest["config"]["num_shards"])}
    return [s for s in reader.shards if s in wanted]


def stratified_picks(reader: CacheReader, shards: list[str], n: int, seed: int) -> list[tuple[str, int]]:
    """(shard, row) pairs for the full recompute (DESIGN 10): one random sample of every shard, the
    longest sample, the truncated ones (as long as max_length), then random ones, up to n; more
    when there are more shards than n, since every shard is covered."""
    rng = random.Random(seed)
    max_length = reader.manifest["config"]["capture"]["max_length"]
    lengths = [np.diff(reader.shard(name).offsets) for name in shards]
    budget = max(n, len(shards) + 1)
    picks: list[tuple[str, int]] = []

    def take(k: int, row: int) -> None:
        if (shards[k], row) not in picks and len(picks) < budget:
            picks.append((shards[k], row))

    for k in range(len(shards)):
        take(k, rng.randrange(len(lengths[k])))
    longest = max(range(len(shards)), key=lambda k: lengths[k].max())
    take(longest, int(lengths[longest].argmax()))
    for k in range(len(shards)):
        for row in np.flatnonzero(lengths[k] >= max_length):
            take(k, int(row))
    starts = np.cumsum([0] + [len(x) for x in lengths])
    for index in rng.sample(range(int(starts[-1])), min(int(starts[-1]), 2 * budget)):
        k = int(np.searchsorted(starts, index, side="right")) - 1
        take(k, int(index - starts[k]))
    return picks


def check_completeness(reader: CacheReader, spec: str | None) -> Check:
    """Every one of the cache's num_shards (or of --shards) is committed."""
    wanted = None if spec is None else parse_shards(spec, reader.manifest["config"]["num_shards"])
    found = missing_shards(reader.manifest, wanted)
    if not found["missing"]:
        return Check("completeness", True, f"all {found['checked']} shards committed", found)
    return Check("completeness", False, describe_missing(found) + "; extract the missing shards (same command)", found)


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
            out = model(input_ids=ids.to(next(model.parameters()).device), output_hidden_states=True)
        states = torch.stack([h[0].float().cpu() for h in out.hidden_states])  # [L+1, T, H]
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
        logits = out.logits[0].float().cpu()
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
        "kernel_path_now": now, "kernel_path_recorded": recorded, "samples": len(picks),
        "picked": [f"{name} row {row}" for name, row in picks]})


def shard_tokens(shard, names=("input_ids", "loss_mask"), *, tap: int | None = None, max_tokens: int | None = None):
    """Per sample of a shard: (row, sample id, {name: array}), read in windows of whole samples
    (a handful of reads per window, not per sample). With `tap`, also "tap": that tap's hidden
    states decoded to float32 (the other taps are not decoded)."""
    for lo, hi in sample_windows(shard.offsets, max_tokens or WINDOW_TOKENS):
        a, b = int(shard.offsets[lo]), int(shard.offsets[hi])
        arrays = {name: shard.read_range(name, a, b) for name in names}
        if tap is not None:
            bits = shard.read_range("hidden", a, b)[:, tap]
            arrays["tap"] = (decode_bf16(bits).float() if shard.hidden_format == "bf16"
                             else decode_fp8(bits, shard.read_range("hidden_scale", a, b)[:, tap]))
        for row in range(lo, hi):
            s, e = int(shard.offsets[row]) - a, int(shard.offsets[row + 1]) - a
            yield row, int(shard.sample_ids[row]), {name: arr[s:e] for name, arr in arrays.items()}


@torch.no_grad()
def tail_errors(model, lm_head, deepest_tap: int, samples: list[dict], logits_chunk: int = 2048) -> list[dict]:
    """Per sample, how far the stored predictions are from the tail recompute: the largest
    shortfall of the stored argmax's logit below the best logit, of |stored top-k logit -
    recomputed|, of |stored logsumexp - recomputed|, with the position of each."""
    lasts = tail_forward(model, deepest_tap, [s["tap"] for s in samples])
    out = []
    for sample, last in zip(samples, lasts):
        worst = {"argmax": (0.0, -1), "topk": (0.0, -1), "logsumexp": (0.0, -1)}
        for a in range(0, len(last), logits_chunk):
            logits = lm_head(last[a:a + logits_chunk]).float().cpu()
            b = a + len(logits)
            argmax = torch.from_numpy(sample["target_argmax"][a:b].astype(np.int64))
            top_ids = torch.from_numpy(sample["target_topk_ids"][a:b].astype(np.int64))
            errors = {
                "argmax": logits.max(-1).values - logits.gather(1, argmax[:, None])[:, 0],
                "topk": (logits.gather(1, top_ids) - torch.from_numpy(sample["target_topk_logits"][a:b])).abs().amax(-1),
                "logsumexp": (torch.logsumexp(logits, -1) - torch.from_numpy(sample["target_logsumexp"][a:b])).abs(),
            }
            for key, err in errors.items():
                err = torch.nan_to_num(err, nan=float("inf"))  # a NaN prediction is as wrong as can be
                at = int(err.argmax())
                if float(err[at]) > worst[key][0]:
                    worst[key] = (float(err[at]), a + at)
        out.append(worst)
    return out


def check_tail(reader: CacheReader, shards: list[str], model, rate: float, seed: int, compute_dtype: str = "float32",
               batch_tokens: int = 8192) -> Check:
    """Every sample (or the --tail-rate fraction): the stored deepest tap, run through the layers
    after it, the final norm and the lm_head, must reproduce the stored argmax, top-k logits and
    logsumexp within the storage tolerance (DESIGN 10)."""
    cap = reader.manifest["config"]["capture"]
    deepest, num_layers = max(cap["target_layer_ids"]), cap["num_hidden_layers"]
    k = cap["target_layer_ids"].index(deepest)
    # Computing in bf16 (on a GPU) adds its own rounding: a wider band, not yet measured on a GPU.
    tol = {key: value * (4 if compute_dtype == "bfloat16" else 1) for key, value in TAIL_TOLERANCE[reader.hidden_format].items()}
    rng = random.Random(seed)
    offending, checked, tokens, worst = SampleList(), 0, 0, {"argmax": 0.0, "topk": 0.0, "logsumexp": 0.0}
    start = time.perf_counter()
    counter = KernelCallCounter(model)

    def run(batch):
        nonlocal checked, tokens
        with counter:
            errors = tail_errors(model, model.lm_head, deepest, batch)
        for sample, err in zip(batch, errors):
            checked += 1
            tokens += len(sample["tap"])
            for key, (value, pos) in err.items():
                worst[key] = max(worst[key], value)
            bad = [f"{key} off by {value:.3g} at position {pos}" for key, (value, pos) in err.items() if value > tol[key]]
            if bad:
                offending.add(sample["shard"], sample["sample_id"], "; ".join(bad))

    # Windows hold at most ~256 MB of raw taps (about 5,000 tokens at Qwen3.6-27B's width).
    window = max(1, (256 << 20) // (len(cap["target_layer_ids"]) * cap["hidden_size"] * 2))
    names = ("target_argmax", "target_topk_ids", "target_topk_logits", "target_logsumexp")
    for name, shard in sound_shards(reader, shards):
        batch, size = [], 0
        try:
            for _, sid, sample in shard_tokens(shard, names, tap=k, max_tokens=window):
                if rate < 1.0 and rng.random() >= rate:
                    continue
                sample.update(shard=name, sample_id=sid)
                if batch and (len(batch) + 1) * max(size, len(sample["tap"])) > batch_tokens:
                    run(batch)
                    batch, size = [], 0
                batch.append(sample)
                size = max(size, len(sample["tap"]))
        except PipelineError:
            pass  # an undecodable chunk: reported by the checksum check; what was read is still checked
        if batch:
            run(batch)
    seconds = time.perf_counter() - start
    layers_run = num_layers - 1 - deepest
    summary = (f"{checked} samples, {tokens} tokens: layers {deepest + 1}..{num_layers - 1} + norm + lm_head from the "
               f"stored tap {deepest} ({layers_run} of {num_layers} layers) reproduce the stored predictions"
               if not offending else f"{checked} samples: {offending.describe()}")
    summary += (f"; worst argmax shortfall {worst['argmax']:.3g}, top-k logit {worst['topk']:.3g}, logsumexp "
                f"{worst['logsumexp']:.3g} (tolerance {tol['argmax']}/{tol['topk']}/{tol['logsumexp']}); {seconds:.1f} s")
    return Check("tail_recompute", not offending, summary, {
        "samples": checked, "tokens": tokens, "rate": rate, "seconds": seconds, "worst": worst, "tolerance": tol,
        "layers_run": layers_run, "num_hidden_layers": num_layers, "layer_fraction": layers_run / num_layers,
        "kernel_path_now": kernel_record(model, counter.counts)["path"], **offending.evidence()})


def check_loss_masks(reader: CacheReader, shards: list[str], tokenizer) -> Check:
    """Re-derive every sample of the shards from the dataset the manifest names, with its chat
    template, mode and reasoning policy: the same rule extract applied (DESIGN 3.5, 10)."""
    sources = reader.manifest.get("sources", {}).get("data", [])
    files = reader.manifest["config"]["data"]["files"]
    paths = [Path(p) for p in sources]
    if not paths or not all(p.is_file() for p in paths):
        return Check("loss_mask", True, "skipped: the dataset the manifest names is not readable here", skipped=True)
    if [sha256_file(p) for p in paths] != [f["sha256"] for f in files]:
        return Check("loss_mask", False, "the dataset files differ from the ones the cache was made with (sha256)")
    tok_cfg = reader.manifest["config"]["tokenizer"]
    max_length = reader.manifest["config"]["capture"]["max_length"]
    masker = ConversationMasker(tokenizer, tok_cfg["end_of_turn"], tok_cfg["chat_template_kwargs"],
                                tok_cfg.get("reasoning", "error"))
    index, _ = index_rows(paths, on_error="skip")
    mismatched, checked = SampleList(), 0
    for name, shard in sound_shards(reader, shards):
        rows = {r.sample_id: r for r in iter_rows(paths, on_error="skip", wanted=set(shard.sample_ids.tolist()), index=index)
                if not isinstance(r, PipelineError)}
        try:
            for _, sid, stored in shard_tokens(shard):
                checked += 1
                row = rows.get(sid)
                if row is None:
                    mismatched.add(name, sid, "row not readable in the dataset")
                    continue
                if row.messages is not None:
                    try:
                        t = masker(row.messages, tools=row.tools, row_kwargs=row.template_kwargs, where=row.where)
                    except PipelineError as e:
                        mismatched.add(name, sid, f"cannot be re-derived ({e})")
                        continue
                    ids, mask = t.input_ids[:max_length], t.loss_mask[:max_length]
                else:
                    ids, mask = row.input_ids[:max_length], row.loss_mask[:max_length]
                if stored["input_ids"].tolist() != ids:
                    mismatched.add(name, sid, f"{row.where}: input_ids differ from re-tokenization")
                elif (stored_mask := stored["loss_mask"].tolist()) != mask:
                    at = next(i for i, (x, y) in enumerate(zip(stored_mask, mask)) if x != y)
                    mismatched.add(name, sid, f"{row.where}: loss_mask differs first at position {at}")
        except PipelineError:
            continue  # an undecodable chunk: reported by the checksum check
    return Check("loss_mask", not mismatched,
                 f"{checked} samples re-derived from the chat template"
                 + (f": {mismatched.describe()} differ" if mismatched else ": identical"),
                 {"samples": checked, **mismatched.evidence()})


def check_mask_boundaries(reader: CacheReader, shards: list[str], tokenizer) -> Check:
    """Every stored mask obeys the rule (no dataset needed, only the tokenizer's chat tokens)."""
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" not in vocab:
        return Check("mask_boundaries", True, "skipped: the tokenizer has no <|im_start|> turn marker", skipped=True)
    end = reader.manifest["config"]["tokenizer"]["end_of_turn"]
    newline = newline_tokens(tokenizer, reader.manifest["config"]["capture"]["vocab_size"])
    kinds: dict[str, SampleList] = {}
    checked = 0
    for name, shard in sound_shards(reader, shards):
        try:
            for _, sid, stored in shard_tokens(shard):
                checked += 1
                found = mask_violations(stored["input_ids"], stored["loss_mask"], turn_start=vocab["<|im_start|>"],
                                        end_of_turn=vocab[end], newline=newline, decode=tokenizer.decode)
                for kind, pos in found.items():
                    kinds.setdefault(kind, SampleList()).add(name, sid, f"position {pos}")
        except PipelineError:
            continue  # reported by the checksum check
    summary = (f"{checked} samples: headers, system/user/tool turns unsupervised; {end} supervised" if not kinds else
               f"{checked} samples: " + "; ".join(f"{kind} ({found.describe()})" for kind, found in kinds.items()))
    return Check("mask_boundaries", not kinds, summary,
                 {"samples": checked, "violations": {k: v.evidence() for k, v in kinds.items()}})


def compute_placement(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """Where the model-based checks run: a GPU in bfloat16 when one is present, else CPU float32."""
    if device not in ("auto", "cpu", "cuda"):
        raise PipelineError(f"--device must be auto, cpu or cuda, got {device!r}")
    if dtype not in ("auto", "float32", "bfloat16"):
        raise PipelineError(f"--dtype must be auto, float32 or bfloat16, got {dtype!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise PipelineError("--device cuda: no CUDA device is available here")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    chosen = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return chosen, getattr(torch, dtype if dtype != "auto" else ("bfloat16" if use_cuda else "float32"))


def run_verify(cache_dir: Path, *, shards: str | None = None, target: Path | None = None, recompute: int = 0,
               tail_rate: float = 1.0, sample_rate: float = 1.0, seed: int = 0, device: str = "auto",
               dtype: str = "auto", progress: bool = False) -> dict:
    start = time.perf_counter()
    if not 0.0 < sample_rate <= 1.0:
        raise PipelineError(f"--sample-rate must be in (0, 1], got {sample_rate}")
    if not 0.0 <= tail_rate <= 1.0:
        raise PipelineError(f"--tail-rate must be in [0, 1], got {tail_rate}")
    if recompute < 0:
        raise PipelineError(f"--recompute must be >= 0, got {recompute}")
    placement = compute_placement(device, dtype)
    try:
        reader = open_cache(cache_dir)
    except PipelineError as e:
        if not cache_dir.is_dir():
            raise
        return {"cache": str(cache_dir), "passed": False, "checks": [Check("manifest", False, str(e)).record()]}
    selected = select_shards(reader, shards)
    checks = [Check("manifest", True, f"schema {reader.manifest['schema_version']}, {len(reader.shards)} committed shards, "
                                      f"{len(selected)} selected")]
    checks.append(check_completeness(reader, shards))
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
    compute = None
    if target_dir is not None and present:
        tokenizer = load_tokenizer(target_dir)
        checks.append(check_target_identity(reader, target_dir, tokenizer))
        checks.append(check_mask_boundaries(reader, present, tokenizer))
        checks.append(check_loss_masks(reader, present, tokenizer))
        if tail_rate > 0 or recompute:
            model = load_model(target_dir, dtype=placement[1]).to(placement[0])
            compute = {"device": str(placement[0]), "dtype": str(placement[1]).removeprefix("torch.")}
            if tail_rate > 0:
                checks.append(check_tail(reader, present, model, tail_rate, seed, compute["dtype"]))
            if recompute:
                tol = 0.02 if reader.hidden_format == "bf16" else 0.1
                if compute["dtype"] == "bfloat16":
                    tol *= 4  # the recompute itself rounds to bf16 (not yet measured on a GPU)
                checks.append(check_recompute(reader, stratified_picks(reader, present, recompute, seed + 1), model, tol))
    else:
        checks.append(Check("loss_mask", True, "skipped: no target to take the tokenizer and chat template from", skipped=True))
    seconds = time.perf_counter() - start
    tokens = sum(reader.manifest["shards"][s]["tokens"] for s in selected)
    return {"cache": str(cache_dir), "passed": all(c.passed for c in checks), "checks": [c.record() for c in checks],
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "compute": compute,
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
