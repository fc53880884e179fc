"""Sampled eval (issue 42): the warping matches transformers' own logits processors, the sampler
is inverse-transform sampling, the random numbers are keyed so batching changes nothing, and
speculative sampling (block and DDTree) is lossless in distribution: samples of the first
generated tokens and of whole short continuations against the target's exact distribution
(plain forwards, harness/sampling_stats.py), with two planted faults caught and the test's power
against them simulated from their exact distributions."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from pipeline.data.prompts import read_prompts
from pipeline.eval.batched import decode_rows
from pipeline.eval.speculative_decoding import block_decode, drafting, tree_decode
from pipeline.sampler import draw, uniform
from pipeline.eval.speculative_sampling import LosslessRule, SpeculativeSampler
from pipeline.target_model.live import LiveTarget
from harness.sampling_stats import categories, chi_square, exact_continuations, simulated_power

EOS = {498}
ALPHA = 0.001          # the distribution test's level: a correct decoder fails it once in 1,000 seeds
SAMPLES = 1000         # samples per distribution test (block; its power against the planted faults needs them)
TREE_SAMPLES = 500     # DDTree's (no planted fault: suite time)
# The prompt and setting of the distribution test: temperature 2 spreads the miniature's peaked
# distributions (at 1.0 with top-p 0.95 its first tokens are certain, and no test can see a
# fault); top-p 0.9 still cuts the tail, so draft tokens of target probability 0 occur.
PROMPT_INDEX = 15
SETTING = dict(temperature=2.0, top_p=0.9)


@pytest.fixture(scope="module")
def drafter(trained_run, embedded):
    from pipeline.drafter.export import load_drafter
    from pipeline.target_model import frozen_target_modules

    embed, head = frozen_target_modules(embedded.TARGET_DIR)
    return load_drafter(trained_run["run"] / "drafter", embed=embed, lm_head=head).eval()


@pytest.fixture(scope="module")
def short_drafter(trained_run, embedded):
    """The same drafter drafting blocks of 4 (3 draft tokens, as `eval --block-size 4`): the
    distribution tests verify 1,000 rows at a time, and a shorter block halves that pass."""
    from pipeline.drafter.export import load_drafter
    from pipeline.target_model import frozen_target_modules

    embed, head = frozen_target_modules(embedded.TARGET_DIR)
    drafter = load_drafter(trained_run["run"] / "drafter", embed=embed, lm_head=head).eval()
    drafter.config.block_size = 4
    return drafter


@pytest.fixture(scope="module")
def live(target, drafter):
    return LiveTarget(target, drafter.config.target_layer_ids)


@pytest.fixture(scope="module")
def report():
    """The distribution tests' figures, written as JSON to $DFLASH_SAMPLING_REPORT when it is set
    (BENCHMARKS.md quotes them)."""
    figures = {}
    yield figures
    if os.environ.get("DFLASH_SAMPLING_REPORT"):
        Path(os.environ["DFLASH_SAMPLING_REPORT"]).write_text(json.dumps(figures, indent=2) + "\n")


@pytest.fixture(scope="module")
def prompts(tokenizer, embedded):
    return [p["ids"] for p in read_prompts(embedded.HELDOUT_DATA, tokenizer, 40)]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.95), (0.6, 20, 0.95), (1.3, 5, 1.0),
                                                     (0.5, 0, 0.3)])
def test_warping_matches_transformers_logits_processors(temperature, top_k, top_p):
    """Temperature, then top-k, then top-p, as transformers' generate applies its warpers."""
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(7)) * 3
    chain = LogitsProcessorList([TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                                + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    reference = torch.softmax(chain(None, logits.clone()), dim=-1)
    ours = SpeculativeSampler(temperature, top_p=top_p, top_k=top_k).warp(logits)
    assert torch.equal(ours > 0, reference > 0)
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-5)


def test_draw_is_inverse_transform_sampling():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0])
    def by_hand(u):  # the first token whose cumulative probability exceeds u
        total = 0.0
        for token, p in enumerate(probs.tolist()):
            total += p
            if u < total:
                return token
    for u in [i / 1000 for i in range(1000)] + [0.999999]:
        assert draw(probs, u) == by_hand(u), u
    # Unnormalised weights (a residual) are drawn as their normalised distribution.
    assert [draw(probs * 7, u) for u in (0.1, 0.3, 0.8)] == [1, 3, 4]


def test_keyed_uniforms_are_uniform_and_independent_of_each_other():
    values = torch.tensor([uniform(3, row, pos, purpose) for row in range(20) for pos in range(250) for purpose in range(4)],
                          dtype=torch.float64)
    assert uniform(3, 1, 2, 0) == uniform(3, 1, 2, 0) and len(set(values.tolist())) == len(values)
    grid = torch.linspace(0, 1, 101)
    empirical = (values[:, None] <= grid[None]).double().mean(0)
    assert float((empirical - grid).abs().max()) < 0.015          # Kolmogorov-Smirnov, 20,000 values: 1.63/sqrt(n) = 0.0115 at 1%
    pairs = values.reshape(-1, 4)                                 # the four purposes of one position
    assert abs(float(torch.corrcoef(pairs.T)[0, 1:].abs().max())) < 0.05
    assert uniform(4, 1, 2, 0) != uniform(3, 1, 2, 0)


def test_sampled_decoding_is_the_same_alone_and_in_a_batch(live, drafter, prompts):
    """One seed scheme: prompt i's tokens depend on the seed and i only, so a batch of 8 decodes
    what eight single-prompt runs decode (block, and DDTree 16 verified as a tree and as paths),
    and another seed decodes others."""
    batch = prompts[:8]
    sampling = SpeculativeSampler(0.7, top_p=0.95, seed=11)
    for budget, verify in ((None, None), (16, "tree"), (16, "paths")):
        single = [block_decode(live, drafter, ids, max_new=24, eos=EOS, sampling=sampling, row=i) if budget is None
                  else tree_decode(live, drafter, ids, max_new=24, eos=EOS, budget=budget, sampling=sampling, row=i,
                                   verify=verify)
                  for i, ids in enumerate(batch)]
        rows = decode_rows(live, drafter, batch, max_new=24, eos=EOS, budget=budget, sampling=sampling,
                           row_ids=list(range(8)))
        for one, many in zip(single, rows):
            assert many.tokens == one.tokens and many.accepted == one.accepted and many.drafts == one.drafts
        assert sum(sum(r.accepted) for r in rows) > 0
    other = [block_decode(live, drafter, ids, max_new=24, eos=EOS, sampling=SpeculativeSampler(0.7, top_p=0.95, seed=12), row=i)
             for i, ids in enumerate(batch)]
    assert [o.tokens for o in other] != [s.tokens for s in single]


class SkippedRejection(LosslessRule):
    """Planted fault: every draft token is accepted."""
    def accepts(self, p_x, q_x, u):
        return True


class ResidualFromTarget(LosslessRule):
    """Planted fault: a rejected position is redrawn from p instead of the residual max(0, p - q)."""
    def residual(self, p, q):
        return p


def _samples(live, drafter, prompt, sampling, length, budget=None, samples=SAMPLES) -> Counter:
    rows = decode_rows(live, drafter, [prompt] * samples, max_new=length, eos=set(), budget=budget, top_k=8,
                       sampling=sampling, row_ids=list(range(samples)))
    assert all(len(r.tokens) == length for r in rows)
    return Counter(tuple(r.tokens) for r in rows)


def _fault_distributions(live, drafter, prompt, sampling, exact1) -> dict[str, dict]:
    """The exact distribution of the first two generated tokens under each planted fault, from
    the rule written out: token 1 is the prefill's draw from p; token 2 is block slot 1's, drafted
    from q(. | token 1): always accepted, it is distributed as q; with the residual replaced by p,
    as min(p, q) + (1 - sum min(p, q)) p."""
    model = live.model
    context = drafting(drafter)
    context.extend(live.run(prompt, None, 0, last_only=True).hidden)
    skipped, from_p = {}, {}
    for (y1,), p1 in exact1.items():
        q = sampling.warp(context.logits(y1, len(prompt)))[0].double()
        with torch.no_grad():
            p = sampling.warp(model(input_ids=torch.tensor([prompt + [y1]])).logits[0, -1]).double()
        overlap = torch.minimum(p, q)
        for name, dist, out in (("skipped", q, skipped), ("from_p", overlap + (1 - overlap.sum()) * p, from_p)):
            for y2 in dist.nonzero()[:, 0].tolist():
                out[(y1, y2)] = p1 * float(dist[y2])
    return {"skipped rejection": skipped, "residual from p": from_p}


def test_block_speculative_sampling_is_lossless_in_distribution(live, short_drafter, prompts, report):
    """The first two generated tokens (the prefill's draw and block slot 1's verdict) and whole
    continuations of four tokens, SAMPLES samples each, against the target's exact distribution:
    the correct rule passes at ALPHA; skipping the rejection test, or redrawing a rejected
    position from p, fails it; the power against each fault (simulated from its exact
    distribution) is at least 0.99."""
    drafter = short_drafter
    prompt = prompts[PROMPT_INDEX]
    sampling = SpeculativeSampler(**SETTING, seed=5)
    exact2 = exact_continuations(live.model, prompt, sampling.warp, 2, 1 / SAMPLES)
    exact4 = exact_continuations(live.model, prompt, sampling.warp, 4, 1 / SAMPLES)
    cats2, cats4 = categories(exact2, SAMPLES), categories(exact4, SAMPLES)
    assert len(cats2) >= 5 and len(cats4) >= 5 and max(exact2.values()) < 0.9   # a spread the test can see into

    observed = _samples(live, drafter, prompt, sampling, 4)
    firsts = Counter()
    for continuation, count in observed.items():
        firsts[continuation[:2]] += count
    two, four = chi_square(firsts, exact2, cats2), chi_square(observed, exact4, cats4)
    figures = report["block"] = {"setting": "temperature 2, top-p 0.9, block 4", "samples": SAMPLES, "alpha": ALPHA,
                                 "two_tokens": dict(zip(("statistic", "df", "p_value"), two)),
                                 "four_tokens": dict(zip(("statistic", "df", "p_value"), four))}
    assert two[2] > ALPHA and four[2] > ALPHA, (two, four)

    exact1 = exact_continuations(live.model, prompt, sampling.warp, 1, 1e-12)
    faults = _fault_distributions(live, drafter, prompt, sampling, exact1)
    for rule, name in ((SkippedRejection(), "skipped rejection"), (ResidualFromTarget(), "residual from p")):
        power = simulated_power(faults[name], exact2, cats2, SAMPLES, ALPHA)
        planted = _samples(live, drafter, prompt, SpeculativeSampler(**SETTING, seed=5, rule=rule), 2)
        statistic, df, p_value = chi_square(planted, exact2, cats2)
        figures[name] = {"power": power, "statistic": statistic, "df": df, "p_value": p_value}
        assert power >= 0.99, (name, power)
        assert p_value < ALPHA, (name, p_value)


def test_ddtree_speculative_sampling_is_lossless_in_distribution(live, short_drafter, prompts, report):
    """DDTree with 8 nodes over 3 depths (children: the drafter's top-8 per depth, under top-k 20
    at temperature 2): continuations of four tokens against the target's exact distribution."""
    drafter = short_drafter
    prompt = prompts[PROMPT_INDEX]
    sampling = SpeculativeSampler(temperature=2.0, top_k=20, seed=9)
    exact4 = exact_continuations(live.model, prompt, sampling.warp, 4, 1 / TREE_SAMPLES)
    cats4 = categories(exact4, TREE_SAMPLES)
    assert len(cats4) >= 5
    observed = _samples(live, drafter, prompt, sampling, 4, budget=8, samples=TREE_SAMPLES)
    statistic, df, p_value = chi_square(observed, exact4, cats4)
    report["ddtree"] = {"setting": "temperature 2, top-k 20, budget 8, block 4", "samples": TREE_SAMPLES,
                        "four_tokens": {"statistic": statistic, "df": df, "p_value": p_value}}
    assert p_value > ALPHA, p_value


def test_eval_cli_samples_and_refuses_sampling_options_without_a_temperature(trained_run):
    """`pipeline eval --temperature`: the sampled figures against plain sampling, no identity
    claimed; --batch-size does not change them (keyed randomness); top-p / top-k without a
    temperature, or a negative one, are refused in one line."""
    from harness.runs import cli_here

    run = str(trained_run["run"])
    args = ["eval", "--drafter", run, "--limit", "3", "--tree-budget", "4", "--temperature", "0.7", "--top-p", "0.95",
            "--seed", "3", "--max-new-tokens", "24", "--json"]
    one, three = cli_here(*args), cli_here(*args, "--batch-size", "3")
    assert one.returncode == 0 and three.returncode == 0, one.stderr + three.stderr
    a, b = json.loads(one.stdout), json.loads(three.stdout)
    assert a["sampling"]["temperature"] == 0.7 and a["sampling"]["top_p"] == 0.95 and a["sampling"]["seed"] == 3
    assert a["lossless"] is None and "greedy" not in a and a["plain_sampling"]["tokens"] > 0
    assert "speedup_vs_plain_sampling" in a["block"] and "identical_to_greedy" not in a["block"]
    for key in ("tau_pooled", "tau_mean_of_means", "accept_histogram", "tokens"):
        assert a["block"][key] == b["block"][key] and a["tree"]["4"][key] == b["tree"]["4"][key], key
    for bad, message in ((["--top-p", "0.9"], "--top-p / --top-k shape sampling: give --temperature > 0"),
                         (["--temperature", "-1"], "--temperature must be >= 0 (0: greedy), got -1.0"),
                         (["--temperature", "1", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5")):
        refused = cli_here("eval", "--drafter", run, "--limit", "1", *bad)
        assert refused.returncode == 1 and message in refused.stderr, refused.stderr


def _vocab_without(excluded: set[int], size: int):
    from pipeline.drafter.vocab import DraftVocab

    return DraftVocab([i for i in range(size) if i not in excluded], size)


def test_greedy_decoding_from_a_draft_vocabulary_is_the_target_greedy(live, drafter, prompts):
    """A drafter whose vocabulary leaves out every third token the target writes: block and DDTree
    decoding still emit the target's greedy tokens, its drafts stay inside the vocabulary, and some
    are accepted (the comparison is not vacuous)."""
    from harness.draft_vocab import with_draft_vocab
    from pipeline.eval.speculative_decoding import greedy

    chosen = prompts[:3]
    plain = [greedy(live, p, max_new=24, eos=EOS).tokens for p in chosen]
    written = sorted({t for tokens in plain for t in tokens})
    vocab = _vocab_without(set(written[::3]), drafter.config.vocab_size)
    restricted = with_draft_vocab(drafter, vocab).eval()
    inside = set(vocab.ids.tolist())
    accepted = 0
    for prompt, want in zip(chosen, plain):
        for decoded in (block_decode(live, restricted, prompt, max_new=24, eos=EOS),
                        tree_decode(live, restricted, prompt, max_new=24, eos=EOS, budget=16)):
            assert decoded.tokens == want
            assert all(t in inside for step in decoded.drafts for t in step)
            accepted += sum(decoded.accepted)
    assert accepted > 0


def test_speculative_sampling_from_a_draft_vocabulary_is_lossless_in_distribution(live, short_drafter, prompts, report):
    """The drafter's q is zero outside a vocabulary that leaves out the later tokens of the target's
    likeliest continuations (the residual max(0, p - q) must supply them): block and DDTree
    continuations of four tokens against the target's exact distribution."""
    from harness.draft_vocab import with_draft_vocab

    prompt = prompts[PROMPT_INDEX]
    sampling = SpeculativeSampler(**SETTING, seed=7)
    exact4 = exact_continuations(live.model, prompt, sampling.warp, 4, 1 / TREE_SAMPLES)
    cats4 = categories(exact4, TREE_SAMPLES)
    likely = sorted(exact4, key=exact4.get, reverse=True)[:3]
    excluded = {t for continuation in likely for t in continuation[1:]}
    touched = sum(p for c, p in exact4.items() if set(c[1:]) & excluded)
    assert touched > 0.3                          # the left-out tokens carry much of the mass
    drafter = with_draft_vocab(short_drafter, _vocab_without(excluded, short_drafter.config.vocab_size)).eval()
    figures = report["draft_vocabulary"] = {"setting": "temperature 2, top-p 0.9, block 4", "samples": TREE_SAMPLES,
                                            "left_out": len(excluded), "mass_touched": touched}
    for name, budget in (("block", None), ("ddtree", 8)):
        observed = _samples(live, drafter, prompt, sampling, 4, budget=budget, samples=TREE_SAMPLES)
        statistic, df, p_value = chi_square(observed, exact4, cats4)
        figures[name] = {"statistic": statistic, "df": df, "p_value": p_value}
        assert p_value > ALPHA, (name, p_value)
