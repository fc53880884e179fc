"""`pipeline eval`: real speculative decoding against the live target, greedy or sampled.

For every prompt: plain greedy decoding (the reference and the speed baseline), block
speculative decoding with the drafter, and DDTree at each node budget. Every speculative output
is compared token for token with greedy (speculative decoding is lossless; a difference is a
bug and is reported). tau (accepted draft tokens + 1 per verify step) is reported as the mean
of per-response means (as the DFlash paper does) and pooled over all steps.

With `--temperature T > 0` the reference is plain sampling and the variants are speculative
sampling (pipeline/eval/speculative_sampling.py): lossless in distribution, which one sample per
prompt cannot show, so outputs are not compared; tests/eval/test_sampling.py tests it.

With `--outputs FILE` every prompt's outputs are written as they are decoded, a JSON line per prompt
(pipeline/eval/outputs.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from pipeline.cache.reader import open_cache
from pipeline.data.prompts import read_prompts
from pipeline.devices import dtype_name, resolve_device
from pipeline.drafter.export import load_drafter
from pipeline.records.eval_result import EvalResult, reference_key, variants_of
from pipeline.records.run_dir import RunDir
from pipeline.sampler import check_sampling
from pipeline.eval.drafter_source import resolve_drafter, target_mismatch
from pipeline.eval.teacher_forced import teacher_forced
from pipeline.embedded import HELDOUT_DATA
from pipeline.errors import PipelineError
from pipeline.eval.compare import REFERENCE, decode_variants
from pipeline.eval.speculative_decoding import TREE_VERIFY, choose_tree_verify, drafting_blocks_of
from pipeline.eval.groups import TurnMarkers, by_field, by_kind
from pipeline.eval.outputs import OutputsWriter, check_outputs_path
from pipeline.eval.speculative_sampling import SpeculativeSampler
from pipeline.eval.summary import summarise
from pipeline.eval.ties import judge_departures
from pipeline.eval.variants import Settings
from pipeline.target_model import end_of_turn_ids, frozen_target_modules, load_target, load_tokenizer, read_target_facts, resolve_target
from pipeline.target_model.internals import takes_mask
from pipeline.target_model.live import LiveTarget
from pipeline.config.train import tracker_names
from pipeline.tracking import report_eval, tracker_class
from stages.eval.options import EvalOptions


def run_eval(options: EvalOptions, *, progress=None, on_total=None, warn=None) -> dict:
    """Decode every prompt with each variant; `progress(n, tokens=, note=)` per batch of prompts,
    `on_total(prompts)` once they are read. tau is also reported per kind of turn and, with
    `group_by`, per value of that row field (pipeline/eval/groups.py). `outputs`: a JSONL
    file of what each prompt decoded, streamed per batch of prompts (pipeline/eval/outputs.py)."""
    o = options
    if o.outputs is not None:  # a path eval could not write is one line before any decoding
        check_outputs_path(Path(o.outputs))
    device_, dtype_ = resolve_device(o.device, o.dtype)
    sampling = sampling_of(o.temperature, o.top_p, o.top_k, o.seed)
    check_decoding_options(o.tree_verify, o.batch_size)

    drafter_dir, recorded = resolve_drafter(o.drafter)
    # Opened first: a cache that cannot be used (shards of another identity among them) is one
    # line before any decoding, not after it.
    cache_reader = open_cache(o.cache) if o.cache is not None else None
    report_to = tracker_names(o.report_to)
    for name in report_to:  # a missing extra or a drafter without its run: one line before any decoding
        tracker_class(name).check_installed()
    if report_to and not RunDir.holding(drafter_dir).train_log.is_file():
        raise PipelineError(f"{drafter_dir}: --report-to needs the drafter's training run (RUN/train_log.jsonl beside it)")
    target_dir = resolve_target(o.target, recorded)
    mismatch = target_mismatch(target_dir, Path(recorded.source)) if recorded else None
    if mismatch and warn:
        warn(f"the target {target_dir} is not the one this drafter was trained against ({recorded.source} recorded "
             f"{recorded.path}): its {mismatch} differ; decoding stays lossless, but the drafts were learned for another model")
    drafter = fitting_drafter(drafter_dir, target_dir, o.block_size, device_, dtype_)
    if any(b < 1 for b in o.tree_budget):
        raise PipelineError(f"--tree-budget values must be >= 1, got {o.tree_budget}")
    tokenizer = load_tokenizer(target_dir)
    model = load_target(target_dir, dtype=dtype_).to(device_)
    live = LiveTarget(model, drafter.config.target_layer_ids)
    tree_verify, tree_verify_reason = tree_verification(model, o.tree_verify, o.tree_budget, o.batch_size)
    items = read_prompts(Path(o.prompts) if o.prompts else HELDOUT_DATA, tokenizer, o.limit)
    check_group_by(o.group_by, items)
    if on_total:
        on_total(len(items))

    prompt_ids = [item["ids"] for item in items]
    settings = Settings(max_new=o.max_new_tokens, eos=end_of_turn_ids(tokenizer), sampling=sampling,
                        batch_size=o.batch_size, tree_top_k=o.tree_top_k, tree_verify=tree_verify)
    variants = variants_of({"tree": o.tree_budget})
    sampled = sampling is not None
    markers = TurnMarkers.of(tokenizer)
    departures = {v: [] for v in variants}
    writer = (OutputsWriter(Path(o.outputs), tokenizer=tokenizer, markers=markers, reference_key=reference_key(sampled),
                            sampled=sampled) if o.outputs is not None else None)

    def finished(first: int, reference: list, runs: dict) -> None:
        """A batch of prompts decoded by every variant: its departures judged, its lines written."""
        batch = prompt_ids[first:first + len(reference)]
        found = {v: [] if sampled else judge_departures(live, batch, results, reference, dtype_, first=first)
                 for v, results in runs.items()}
        for v, judged in found.items():
            departures[v] += judged
        if writer is not None:
            writer.write_batch(first, batch, reference, runs, found)

    with writer if writer is not None else nullcontext():
        reference, runs, seconds = decode_variants(live, drafter, prompt_ids, variants, settings, progress, finished)
        if writer is not None:
            writer.finish()
    block = drafter.config.block_size
    summaries = {v: summarise(results, reference, seconds[v.name], seconds[REFERENCE], block, departures[v], sampled=sampled)
                 for v, results in runs.items()}
    for v in summaries:
        if v.kind.parametrised:  # DDTree: the top-k its trees branch by
            summaries[v]["top_k"] = o.tree_top_k
    greedy_tokens = sum(len(r.tokens) for r in reference)
    result = EvalResult(
        drafter=str(drafter_dir), target=str(target_dir), target_differs_from_training=mismatch, prompts=len(items),
        block_size=block, max_new_tokens=o.max_new_tokens, device=f"{device_} ({dtype_name(dtype_)})",
        cpu_threads=torch.get_num_threads(), drafter_kv_cache=True, tree_verify=tree_verify,
        tree_verify_reason=tree_verify_reason, batch_size=o.batch_size, sampling=sampling.record() if sampled else None,
        reference={"tokens": greedy_tokens, "wall_s": seconds[REFERENCE],
                   "tokens_per_s": greedy_tokens / max(seconds[REFERENCE], 1e-9),
                   "target_passes_per_token": sum(r.target_passes for r in reference) / max(greedy_tokens, 1)},
        variants=summaries, lossless=None if sampled else not any(not d.tie for found in departures.values() for d in found),
        by_kind=by_kind(prompt_ids, reference, runs, markers),
        by_field=by_field(o.group_by, [item["fields"] for item in items], runs) if o.group_by else None,
        teacher_forced=(teacher_forced(drafter, cache_reader, im_start=tokenizer.convert_tokens_to_ids("<|im_start|>"))
                        if cache_reader is not None else None),
        outputs=str(o.outputs) if o.outputs is not None else None)
    if report_to:
        result.reported_to = {"trackers": report_to,
                              "at_step": report_eval(report_to, run_dir=RunDir.holding(drafter_dir).path, result=result,
                                                        warn=warn)}
    return result.to_json()


def fitting_drafter(drafter_dir: Path, target_dir: Path, block_size: int | None, device, dtype):
    """The drafter on `device`, refused in one line where it does not fit the target, drafting
    blocks of --block-size (None: its own); the block is checked by the drafter's config."""
    facts = read_target_facts(target_dir)
    embed, head = frozen_target_modules(target_dir, dtype)
    drafter = load_drafter(drafter_dir, embed=embed, lm_head=head).to(device, dtype).eval()
    c = drafter.config
    if (c.hidden_size, c.vocab_size) != (facts.hidden_size, facts.vocab_size) or max(c.target_layer_ids) >= facts.num_hidden_layers - 1:
        raise PipelineError(f"{drafter_dir}: drafter (hidden {c.hidden_size}, vocab {c.vocab_size}, taps "
                            f"{c.target_layer_ids}) does not fit target {target_dir} (hidden {facts.hidden_size}, "
                            f"vocab {facts.vocab_size}, {facts.num_hidden_layers} layers)")
    if c.projected_rank is not None:
        raise PipelineError(f"{drafter_dir}: this drafter's fc reads taps projected to {c.projected_rank} values (a "
                            "checkpoint's form, not folded yet): evaluate its run's final export (RUN/drafter), whose "
                            "fc reads the taps the live target gives")
    try:
        return drafting_blocks_of(drafter, c.block_size if block_size is None else block_size, name="--block-size")
    except ValueError as e:   # the config's check, named as the user typed it
        raise PipelineError(str(e)) from None


def check_group_by(group_by: str | None, items: list[dict]) -> None:
    if group_by and not any(group_by in item["fields"] for item in items):
        seen = sorted({k for item in items for k in item["fields"]})
        raise PipelineError(f"--group-by {group_by}: no prompt row has this field (the rows' fields: "
                            f"{', '.join(seen) or 'none besides the conversation'})")


def check_decoding_options(tree_verify: str, batch_size: int) -> None:
    if tree_verify not in (*TREE_VERIFY, "auto"):
        raise PipelineError(f"--tree-verify: must be one of {', '.join(TREE_VERIFY)}, auto; got {tree_verify!r}")
    if batch_size < 1:
        raise PipelineError(f"--batch-size must be >= 1, got {batch_size}")
    if batch_size > 1 and tree_verify == "paths":
        raise PipelineError("--batch-size > 1 verifies each prompt's tree in one pass over its nodes: use --tree-verify tree")


def tree_verification(model, tree_verify: str, tree_budgets: list[int], batch_size: int) -> tuple[str, str]:
    """(how DDTree's trees are verified, why): as asked, or for "auto" by the target's size
    without its embeddings (pipeline/eval/speculative_decoding.py: choose_tree_verify)."""
    reason = "asked for"
    if tree_verify == "auto":
        embeddings = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
                      for p in m.parameters()}
        body = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
        tree_verify, reason = choose_tree_verify(body, batch_size=batch_size, takes_mask=takes_mask(model))
    if (tree_budgets or batch_size > 1) and tree_verify == "tree" and not takes_mask(model):
        raise PipelineError("the target's attention implementation takes no tree mask (sdpa and eager do): "
                            "use --tree-verify paths and --batch-size 1")
    return tree_verify, reason


def sampling_of(temperature: float, top_p: float, top_k: int, seed: int) -> SpeculativeSampler | None:
    """None (greedy) at temperature 0, else eval's sampler. The options are checked by the
    sampler's one rule (pipeline/sampler.py), here too at temperature 0, where no sampler is made."""
    check_sampling(temperature, top_p, top_k)
    return SpeculativeSampler(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed) if temperature > 0 else None
