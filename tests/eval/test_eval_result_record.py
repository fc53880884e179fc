"""eval's result record (pipeline/records/eval_result.py): the variant registry puts each
variant's figures where `pipeline eval --json` has always put them and names them as the tables,
trackers and the demo always have. The expected shapes and names are written out here by hand."""

from __future__ import annotations

import pytest

from pipeline.errors import PipelineError
from pipeline.records.eval_result import (KINDS, EvalResult, flat, flat_in, grouped_labels, nest, pooled_taus,
                                          variants_in, variants_of)

RESULT = {"prompts": 3, "block": {"tau_pooled": 2.5, "tau_mean_of_means": 2.25, "speedup_vs_greedy": 1.5},
          "tree": {"8": {"tau_pooled": 3.0}, "16": {"tau_pooled": 3.5}}, "lossless": True}


def test_variants_in_walks_block_then_each_budget_in_the_result_order():
    found = [(v.name, v.label, v.plot_label, v.scalar, figures["tau_pooled"]) for v, figures in variants_in(RESULT)]
    assert found == [("block", "block", "block", "block", 2.5), ("tree8", "ddtree 8", "DDTree 8", "ddtree8", 3.0),
                     ("tree16", "ddtree 16", "DDTree 16", "ddtree16", 3.5)]


def test_nest_is_the_inverse_of_variants_in_and_keeps_the_json_key_order():
    rebuilt = nest(dict(variants_in(RESULT)))
    assert rebuilt == {"block": RESULT["block"], "tree": RESULT["tree"]}
    assert list(rebuilt) == ["block", "tree"] and list(rebuilt["tree"]) == ["8", "16"]
    assert nest({v: 0 for v in variants_of({})}) == {"block": 0, "tree": {}}  # no budgets: an empty tree, as eval writes


def test_flat_names_and_their_reader():
    scalars = flat(variants_in(RESULT), "tau_pooled", prefix="sampled_")
    assert scalars == {"sampled_block_tau_pooled": 2.5, "sampled_ddtree8_tau_pooled": 3.0, "sampled_ddtree16_tau_pooled": 3.5}
    demo = {"block_tau_mean_of_means": 2.25, "block_tau_pooled": 2.5, "ddtree16_tau_pooled": 3.5, "ddtree4_tau_pooled": 2.75,
            "block_speedup_vs_greedy_cpu": 1.5, "prompts": 3}
    assert [(v.name, x) for v, x in flat_in(demo, "tau_pooled")] == [("block", 2.5), ("tree16", 3.5), ("tree4", 2.75)]
    assert grouped_labels([v for v, _ in flat_in(demo, "tau_pooled")]) == "block / DDTree 16, 4"


def test_pooled_taus_needs_the_block_and_tolerates_no_trees():
    assert pooled_taus(RESULT) == {"block": 2.5, "tree": {"8": 3.0, "16": 3.5}}
    assert pooled_taus({"block": {"tau_pooled": 1}}) == {"block": 1.0, "tree": {}}
    with pytest.raises(KeyError, match="block"):
        pooled_taus({"tree": {}})


def test_the_registry_order_is_the_variants_order():
    assert [k.key for k in KINDS] == ["block", "tree"]
    assert [v.name for v in variants_of({"tree": [4, 2]})] == ["block", "tree4", "tree2"]


def full_document(sampled: bool) -> dict:
    """An eval `--json` document as eval writes it, key for key in its order (written out by hand)."""
    doc = {"teacher_forced": {"tau_walk": 2.1, "tau_estimate": 2.3, "anchors": 40, "accuracy": 0.5},
           "drafter": "run/drafter", "target": "target", "target_differs_from_training": None, "prompts": 3,
           "block_size": 4, "max_new_tokens": 96, "device": "cpu (float32)", "cpu_threads": 2, "drafter_kv_cache": True,
           "tree_verify": "tree", "tree_verify_reason": "asked for", "batch_size": 1,
           "sampling": {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "seed": 0} if sampled else None,
           ("plain_sampling" if sampled else "greedy"): {"tokens": 30, "wall_s": 1.0, "tokens_per_s": 30.0,
                                                         "target_passes_per_token": 1.0},
           "block": RESULT["block"], "tree": RESULT["tree"], "lossless": None if sampled else True,
           "by_kind": {"thinking": {"prompts": 3, "block": {"tau_pooled": 2.5}, "tree": {"8": {"tau_pooled": 3.0}}}}}
    if not sampled:
        doc["by_field"] = {"field": "source", "groups": {}}
    return doc


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_an_eval_document_round_trips_in_its_key_order(sampled):
    doc = full_document(sampled)
    result = EvalResult.from_json(doc)
    assert result.reference == doc["plain_sampling" if sampled else "greedy"]
    assert [v.name for v in result.variants] == ["block", "tree8", "tree16"]
    assert result.to_json() == doc and list(result.to_json()) == list(doc)
    result.reported_to = {"trackers": ["tensorboard"], "at_step": 250}
    assert list(result.to_json())[-1] == "reported_to"


def test_an_older_eval_document_reads_what_it_has_and_a_foreign_one_is_one_line():
    older = {"prompts": 2, "lossless": True, "block": {"tau_pooled": 2.0}, "tree": {}}
    result = EvalResult.from_json(older)
    assert (result.prompts, result.lossless, result.drafter, result.by_kind, result.reference) == (2, True, None, {}, {})
    with pytest.raises(PipelineError, match=r"^x.json: not a `pipeline eval --json` result \(missing or bad field 'block'\)$"):
        EvalResult.from_json({"prompts": 2, "lossless": True, "tree": {}}, "x.json")


def test_an_older_eval_file_reads_as_today_s_one_mismatch_list():
    """Issue 57: `mismatched_prompts` (the prompts' numbers) and `mismatches` (one record per such
    prompt) said one thing; eval writes only `mismatches` now. A file from before the records (the
    numbers alone) and one from between (both) read with `mismatches` only, written here by hand."""
    record = {"prompt": 2, "position": 7, "greedy_token": 11, "speculative_token": 12, "gap": 3.0, "tolerance": 0.25,
              "tie": False}
    oldest = {**RESULT, "lossless": False, "block": {**RESULT["block"], "mismatched_prompts": [2, 5]}}
    between = {**RESULT, "lossless": False, "block": {**RESULT["block"], "mismatched_prompts": [2], "mismatches": [record]}}
    blank = {"position": None, "greedy_token": None, "speculative_token": None, "gap": None, "tolerance": None, "tie": False}
    [(_, figures)] = [(v, f) for v, f in EvalResult.from_json(oldest).variants.items() if v.name == "block"]
    assert "mismatched_prompts" not in figures
    assert figures["mismatches"] == [{"prompt": 2, **blank}, {"prompt": 5, **blank}]
    [(_, figures)] = [(v, f) for v, f in EvalResult.from_json(between).variants.items() if v.name == "block"]
    assert "mismatched_prompts" not in figures and figures["mismatches"] == [record]
    assert figures["tau_pooled"] == 2.5
    trees = EvalResult.from_json(RESULT).variants   # a lossless file is read as written
    assert [f for v, f in trees.items() if v.name == "tree8"] == [{"tau_pooled": 3.0}]
