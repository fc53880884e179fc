"""`pipeline eval`: real speculative decoding is lossless, rolls the hybrid cache back exactly, and
its acceptance agrees with the teacher-forced estimate from training."""

import functools
import json

import pytest
import torch
from harness.runs import cli, cli_here, small_cache
from harness.prerequisites import importable

from pipeline.drafter.model import DFlashDrafter, DrafterConfig
from pipeline.errors import PipelineError
from pipeline.eval.speculative_decoding import block_decode, greedy
from pipeline.target_model.live import LiveTarget
from pipeline.eval.tree import build_tree
from pipeline.data.prompts import read_prompts
from stages.eval.options import EvalOptions
from stages.eval.run import run_eval
from pipeline.target_model import frozen_target_modules

EOS = {498}


@pytest.fixture(scope="module")
def trained(trained_run):
    """The shared drafter trained briefly on the embedded target's cache (the run directory)."""
    return trained_run["run"]


@pytest.fixture(scope="module")
def live(target):
    return LiveTarget(target, [1, 3, 5])


@pytest.fixture(scope="module")
def prompts(tokenizer, embedded):
    return read_prompts(embedded.HELDOUT_DATA, tokenizer, None)


# Of the 200 held-out prompts. The fixture is the suite's slowest: 94 s at 200 on the first kit; on the
# thinking, tool-calling kit (rows about three times as long) 265 s at 64, so 32.
PROMPTS = 32


@pytest.fixture(scope="module")
def full_eval(trained, heldout_rows, tmp_path_factory):
    """One eval over the first PROMPTS of the 200 held-out prompts (suite time; greedy, block, DDTree 16;
    8 prompts per verify pass:
    the single-prompt decoders are checked against these step by step, and on the odd prompts),
    plus the teacher-forced metrics on a cache of the same conversations."""
    root = tmp_path_factory.mktemp("heldout")
    heldout = small_cache(root, heldout_rows[:PROMPTS], 2)
    return run_eval(EvalOptions(drafter=trained, target=None, prompts=root / "convs.jsonl", max_new_tokens=96,
                                block_size=None, tree_budget=[16], tree_top_k=8, limit=PROMPTS,
                                cache=heldout, batch_size=8))


def test_block_and_tree_decoding_equal_greedy_on_every_evaluated_prompt(full_eval):
    result = full_eval
    assert result["prompts"] == PROMPTS
    assert result["lossless"], (result["block"]["mismatches"], result["tree"]["16"]["mismatches"])
    assert result["block"]["identical_to_greedy"] == result["tree"]["16"]["identical_to_greedy"] == PROMPTS
    block = result["block"]
    assert sum(block["accept_histogram"].values()) * block["tau_pooled"] == pytest.approx(block["tokens"], rel=0.02)
    # No second target pass after a rejection, nor a commit pass after a tree: one prefill per
    # prompt, then exactly one target pass per verify step.
    for run in (block, result["tree"]["16"]):
        assert run["target_passes_per_token"] == pytest.approx(run["verify_passes_per_token"] + PROMPTS / run["tokens"], rel=1e-9)
    assert block["tau_pooled"] > 2.0, block  # an untrained drafter stays at about 1 (next test)
    assert result["tree"]["16"]["tau_pooled"] >= block["tau_pooled"] - 0.05


def untrained_drafter(embedded, block: int = 4) -> DFlashDrafter:
    """A random drafter of the embedded target's width: drafts it rarely accepts."""
    torch.manual_seed(0)
    embed, head = frozen_target_modules(embedded.TARGET_DIR)
    return DFlashDrafter(DrafterConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                       num_attention_heads=6, num_key_value_heads=1, head_dim=32, vocab_size=512,
                                       target_layer_ids=[1, 3, 5], num_target_layers=8, mask_token_id=499,
                                       block_size=block), embed=embed, lm_head=head).eval()


def test_an_oracle_drafter_reaches_the_block_size_and_an_untrained_one_about_one(live, prompts, embedded):
    long = []   # (prompt, its greedy answer)
    for p in prompts:
        answer = greedy(live, p["ids"], max_new=96, eos=EOS).tokens
        if len(answer) >= 40:
            long.append((p, answer))
        if len(long) == 5:
            break
    assert long, "no held-out prompt with a long answer"
    block = 8
    for p, reference in long:
        start = len(p["ids"])

        def oracle(anchor, pos, reference=reference, start=start):
            # The target's own greedy continuation after the anchor (pos - start indexes the output).
            ahead = reference[pos - start + 1:pos - start + block]
            return ahead + [0] * (block - 1 - len(ahead))

        tokens_before, passes_before = live.tokens, live.passes
        run = block_decode(live, None, p["ids"], max_new=96, eos=EOS, draft=oracle)
        assert run.tokens == reference
        assert all(a == block - 1 for a in run.accepted[:-1]), run.accepted  # tau = B on every full step
        # the accounting eval reports: every token the target took after the prompt was a verify
        # pass's (the bonus and the drafts of each step), one prefill pass then one a step
        assert run.verify_tokens == live.tokens - tokens_before - len(p["ids"]) == len(run.drafts) * block
        assert run.target_passes == live.passes - passes_before == 1 + run.verify_passes == 1 + len(run.accepted)
    untrained = untrained_drafter(embedded, block)
    steps = [a + 1 for p, _ in long for a in block_decode(live, untrained, p["ids"], max_new=96, eos=EOS).accepted]
    assert sum(steps) / len(steps) < 1.3, steps


@pytest.mark.parametrize("verify", ["tree", "paths"])
def test_ddtree_follows_an_oracle_tree_to_its_depth_and_decodes_the_greedy_tokens(live, prompts, verify):
    """A draft tree whose best path is the target's own greedy continuation, with noisy siblings at
    every depth: each full step accepts the whole path (block - 1 tokens), the output is greedy's,
    and every token the target took after the prompt was a verify pass's."""
    from pipeline.eval.speculative_decoding import tree_decode

    block, vocab = 8, live.model.config.vocab_size
    for p in prompts[:3]:
        reference = greedy(live, p["ids"], max_new=48, eos=EOS).tokens
        start = len(p["ids"])
        noise = torch.Generator().manual_seed(start)

        def oracle(anchor, pos, reference=reference, start=start):
            ahead = reference[pos - start + 1:pos - start + block]
            logits = torch.randn(block - 1, vocab, generator=noise)
            logits[torch.arange(len(ahead)), torch.tensor(ahead, dtype=torch.long)] += 12.0
            return logits

        tokens_before, passes_before = live.tokens, live.passes
        run = tree_decode(live, None, p["ids"], max_new=48, eos=EOS, budget=24, verify=verify, draft=oracle)
        assert run.tokens == reference
        assert all(a == block - 1 for a in run.accepted[:-1]), run.accepted
        assert run.verify_tokens == live.tokens - tokens_before - len(p["ids"])
        assert run.verify_passes == len(run.accepted) == len(run.drafts)
        assert run.target_passes == live.passes - passes_before == 1 + run.verify_passes
        # the tree pass takes each node once (the bonus and the tree); the paths repeat shared prefixes
        nodes = sum(len(d) + 1 for d in run.drafts)
        assert run.verify_tokens == nodes if verify == "tree" else run.verify_tokens > nodes


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("verify", ["tree", "paths"])
def test_a_tree_walk_follows_the_targets_choices_and_commits_the_path_it_accepts(live, prompts, verify, sampled):
    """One DDTree step against an oracle written from the rule with plain forwards: from the
    root, the target's token after the path so far (the argmax, or its draw keyed at position
    pos + 1 + depth) is accepted while it is a child in the tree. The walk returns those tokens,
    the token after them, the tapped hidden states of the bonus and accepted tokens, and a state
    that continues exactly as a plain forward of them. The tree holds the oracle's path to depth 4,
    with two more candidates beside its last token, and then goes elsewhere, among noisy siblings,
    so the walk stops inside it; a chain (one path) too."""
    from pipeline.eval.speculative_decoding import Chooser, _verify_as_paths, _verify_as_tree
    from pipeline.eval.speculative_sampling import SpeculativeSampler

    sampling = SpeculativeSampler(temperature=1.0, seed=5) if sampled else None
    row, vocab = 2, live.model.config.vocab_size
    walk = _verify_as_tree if verify == "tree" else _verify_as_paths
    for prompt in (prompts[0]["ids"][:40], prompts[1]["ids"][:56]):   # short: the prefill is most of the time
        pos = len(prompt)
        pre = live.run(prompt, None, 0, with_hidden=False)
        state, bonus = pre.state, int(pre.logits[-1].argmax())

        @functools.cache
        def choice_after(path: tuple[int, ...]) -> int:
            logits = live.run([bonus, *path], LiveTarget.copy(state), pos, with_hidden=False).logits[-1]
            return int(logits.argmax()) if sampling is None else sampling.pick(row, pos + 1 + len(path), logits)

        def target_token(path: list[int]) -> int:
            return choice_after(tuple(path))

        path = []
        for _ in range(4):
            path.append(target_token(path))
        noise = torch.Generator().manual_seed(pos)
        logits = torch.randn(7, vocab, generator=noise)
        for depth, token in enumerate(path):
            logits[depth, token] += 12.0
        logits[3, [(path[3] + 1) % vocab, (path[3] + 2) % vocab]] += 8.0  # two more candidates at depth 3
        logits[4, (target_token(path) + 1) % vocab] += 12.0   # the tree's best path leaves the target's here
        # a bushy tree, and a chain (one path: top 1 at every depth)
        for tree in (build_tree(torch.log_softmax(logits, -1), 24, 8), build_tree(torch.log_softmax(logits, -1), 6, 1)):
            # the oracle's walk over this tree
            accepted, nodes = [], [-1]
            while (child := tree.children.get(nodes[-1], {}).get(token := target_token(accepted))) is not None:
                accepted.append(token)
                nodes.append(child)
            assert len(accepted) >= 4, (accepted, path, tree.children)
            assert len(tree.paths()) == 1 or len(tree.children[nodes[-2]]) == 3   # the walk passes a fork last

            got, choice, committed, hidden = walk(live, tree, bonus, LiveTarget.copy(state), pos, Chooser(sampling, row, pos))
            assert (got, choice) == (accepted, token)
            plain = live.run([bonus, *accepted, 3], LiveTarget.copy(state), pos)
            torch.testing.assert_close(hidden, plain.hidden[:-1], rtol=1e-4, atol=1e-4)
            after = live.run([3], committed, pos + len(accepted) + 1, with_hidden=False).logits[-1]
            torch.testing.assert_close(after, plain.logits[-1], rtol=1e-4, atol=1e-4)




def test_decoding_drafts_through_the_drafters_kv_cache_unless_asked_not_to(live, prompts, embedded, monkeypatch):
    """Block, DDTree and batched decoding draft from the drafter's KV cache by default (the full
    recompute over the context, `draft_logits`, is the reference: quadratic in the answer's length);
    `cached=False` asks for the recompute, which drafts the same tokens."""
    from pipeline.eval import speculative_decoding as sd
    from pipeline.eval.batched import decode_rows

    drafter, calls = untrained_drafter(embedded), []
    recompute = sd.draft_logits
    monkeypatch.setattr(sd, "draft_logits", lambda *args: calls.append(args[2:]) or recompute(*args))
    short = [prompts[0]["ids"][:40], prompts[1]["ids"][:30]]
    run = sd.block_decode(live, drafter, short[0], max_new=6, eos=set())
    assert {len(d) for d in run.drafts} == {drafter.config.block_size - 1}   # B - 1 drafts a step
    assert run.tokens == greedy(live, short[0], max_new=6, eos=set()).tokens and len(run.tokens) == 6  # max_new, no more
    # an untrained drafter: mostly nothing accepted; top 1 at every depth makes the tree one path
    for verify, top_k in (("tree", 8), ("paths", 8), ("paths", 1)):
        tree_run = sd.tree_decode(live, drafter, short[0], max_new=6, eos=set(), budget=8, top_k=top_k, verify=verify)
        assert tree_run.tokens == run.tokens
    decode_rows(live, drafter, short, max_new=6, eos=set())
    decode_rows(live, drafter, short, max_new=6, eos=set(), budget=8)
    assert calls == []
    for decode in (sd.block_decode, functools.partial(sd.tree_decode, budget=8)):
        full = decode(live, drafter, short[0], max_new=6, eos=set(), cached=False)
        assert calls and calls[0][1] == len(short[0])   # the first draft: after the prompt
        assert full.drafts == decode(live, drafter, short[0], max_new=6, eos=set()).drafts
        calls.clear()


def test_a_prompt_sampled_alone_is_prompt_0_of_a_batch(live, prompts, embedded):
    """Sampled, a prompt decoded alone without a row draws the numbers of the first prompt of a
    batch (eval's prompt 0): plain, block and DDTree decoding."""
    from pipeline.eval.batched import decode_rows
    from pipeline.eval.speculative_decoding import greedy_rows, tree_decode
    from pipeline.eval.speculative_sampling import SpeculativeSampler

    drafter, sampling = untrained_drafter(embedded), SpeculativeSampler(temperature=1.0, seed=11)
    prompt = prompts[0]["ids"][:40]
    alone = greedy(live, prompt, max_new=12, eos=set(), sampling=sampling).tokens
    assert alone == greedy_rows(live, [prompt], max_new=12, eos=set(), sampling=sampling)[0].tokens
    assert alone != greedy(live, prompt, max_new=12, eos=set(), sampling=sampling, row=1).tokens  # rows differ
    assert (block_decode(live, drafter, prompt, max_new=12, eos=set(), sampling=sampling).tokens
            == decode_rows(live, drafter, [prompt], max_new=12, eos=set(), sampling=sampling)[0].tokens)
    assert (tree_decode(live, drafter, prompt, max_new=12, eos=set(), budget=8, sampling=sampling).tokens
            == decode_rows(live, drafter, [prompt], max_new=12, eos=set(), budget=8, sampling=sampling)[0].tokens)


def test_the_prefill_state_continues_as_a_full_forward_and_the_drafter_gets_the_prompts_taps(live, prompts):
    """What every decoder starts from: the prompt at positions 0.., the target's first token, a state
    whose next steps give a full forward's logits and taps, and the prompt's taps in the drafter's
    context."""
    from pipeline.eval.speculative_decoding import Recomputed, _prefill

    prompt, context = prompts[0]["ids"][:40], Recomputed(None)
    state, pos, token = _prefill(live, prompt, context, None, 0)
    full = live.run([*prompt, token, 7], None, 0)
    assert (pos, token) == (len(prompt), int(full.logits[pos - 1].argmax()))
    torch.testing.assert_close(context.context, full.hidden[:pos], rtol=1e-4, atol=1e-5)
    after = live.run([token, 7], state, pos)
    torch.testing.assert_close(after.logits, full.logits[pos:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(after.hidden, full.hidden[pos:], rtol=1e-4, atol=1e-4)


def test_rejection_rolls_back_the_recurrent_state_exactly(live, prompts):
    """After a rejection the committed state equals a fresh prefill of the accepted text. Cropping
    only the attention KV cache (the usual trick) leaves the Gated DeltaNet state wrong."""
    prompt = prompts[3]["ids"]
    reference = greedy(live, prompt, max_new=12, eos=EOS).tokens
    bonus, good, wrong = reference[0], reference[1], (reference[2] + 1) % 400
    pos = len(prompt)
    state = live.run(prompt, None, 0).state
    verify = live.run([bonus, good, wrong, wrong], LiveTarget.copy(state), pos)
    assert verify.logits.argmax(-1).tolist()[:2] == [good, reference[2]]  # accept `good`, reject `wrong`
    live.run([bonus, good], state, pos)                                   # what block_decode commits
    nxt = reference[2]
    ours = live.run([nxt], state, pos + 2).logits[-1]
    fresh = live.run(prompt + [bonus, good, nxt], None, 0).logits[-1]
    torch.testing.assert_close(ours, fresh, atol=1e-4, rtol=1e-4)
    # The naive rollback: crop the attention layers' KV cache, leave the linear-attention state.
    naive = verify.state
    for layer in naive.layers:
        if hasattr(layer, "keys") and getattr(layer, "keys", None) is not None:
            layer.keys, layer.values = layer.keys[..., :-2, :], layer.values[..., :-2, :]
    cropped = live.run([nxt], naive, pos + 2).logits[-1]
    assert (cropped - fresh).abs().max() > 1e-2


def test_tree_is_best_first_within_its_budget():
    logprobs = torch.log_softmax(torch.tensor([[3.0, 2.0, 0.0, -1.0], [0.0, 4.0, 1.0, -2.0], [2.0, 2.5, 0.0, 0.0]]), -1)
    tree = build_tree(logprobs, budget=6, top_k=2)
    assert len(tree.tokens) == 6
    scores = []
    for node in range(6):
        s, n = 0.0, node
        while n != -1:
            s += float(logprobs[tree.depths[n], tree.tokens[n]])
            n = tree.parents[n]
        scores.append(s)
    assert scores == sorted(scores, reverse=True)          # popped in score order
    assert tree.tokens[:3] == [0, 1, 1] and tree.depths[:3] == [0, 1, 2]
    assert all(tree.depths[n] == tree.depths[tree.parents[n]] + 1 for n in range(6) if tree.parents[n] != -1)
    assert sorted(len(p) for p in tree.paths()) == sorted(tree.depths[p[-1]] + 1 for p in tree.paths())


def test_eval_tau_agrees_with_the_teacher_forced_estimate(full_eval):
    """Same held-out conversations, anchors in the generated last turn. Replaying decoding on the
    teacher-forced streaks (`tau_walk`) must give eval's pooled tau: stated tolerance 0.15 (the
    features differ only by bf16 storage, and eval counts drafts accepted past the end token).
    DESIGN's avg_streak + 1 weights every position alike, while decoding crosses easy stretches
    in few steps, so it sits above the real tau (by 0.5 at block 8 and 2.1 at block 16 measured):
    it is an optimistic estimate, and tau must not exceed it by more than noise."""
    tf, tau = full_eval["teacher_forced"], full_eval["block"]["tau_pooled"]
    assert abs(tau - tf["tau_walk"]) <= 0.15, (tau, tf["tau_walk"])
    assert tau <= tf["tau_estimate"] + 0.25, (tau, tf["tau_estimate"])


def test_eval_cli_json_and_a_bad_drafter(trained, tmp_path):
    ok = cli("--threads", "1", "eval", "--drafter", str(trained), "--limit", "3", "--tree-budget", "4", "--json")
    assert ok.returncode == 0, ok.stderr
    result = json.loads(ok.stdout)
    assert result["prompts"] == 3 and result["lossless"] and set(result["tree"]) == {"4"}
    assert result["device"] == "cpu (float32)" and result["drafter_kv_cache"]  # auto without a GPU
    # --tree-verify auto on the 1.7 M embedded target: paths (measured faster there, BENCHMARKS).
    assert result["tree_verify"] == "paths" and "< 20 M" in result["tree_verify_reason"], result["tree_verify_reason"]
    assert result["cpu_threads"] == 1
    zero = cli_here("--threads", "0", "eval", "--drafter", str(trained))
    assert zero.returncode == 1 and "--threads must be 'auto' or an integer >= 1, got '0'" in zero.stderr
    bad = cli_here("eval", "--drafter", str(tmp_path))
    assert bad.returncode == 1 and f"{tmp_path}: not a drafter export" in bad.stderr
    big = cli_here("eval", "--drafter", str(trained), "--block-size", "32", "--limit", "1")
    assert big.returncode == 1 and "--block-size must be in 2..8" in big.stderr


def test_eval_warns_when_the_target_is_not_the_one_trained_against(trained, tmp_path, embedded):
    """Same shape, other weights: decoding stays lossless (so nothing else would show it); one
    warning line naming the target and what differs, and the report records it."""
    import shutil

    from safetensors.torch import load_file, save_file

    other = tmp_path / "other-target"
    shutil.copytree(embedded.TARGET_DIR, other)
    weights = load_file(other / "model.safetensors")
    name = next(k for k in sorted(weights) if k.endswith("mlp.down_proj.weight"))
    weights[name] = weights[name] * 1.01
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    warnings = []
    kwargs = dict(prompts=None, max_new_tokens=4, block_size=None, tree_budget=[], tree_top_k=8, limit=2)
    result = run_eval(EvalOptions(drafter=trained, target=other, **kwargs), warn=warnings.append)
    assert result["lossless"] and result["target_differs_from_training"] == "weights (model.safetensors)", result
    assert len(warnings) == 1 and str(other) in warnings[0] and "weights (model.safetensors)" in warnings[0], warnings
    same = run_eval(EvalOptions(drafter=trained, target=embedded.TARGET_DIR, **kwargs), warn=warnings.append)
    assert same["target_differs_from_training"] is None and len(warnings) == 1


def test_eval_device_and_dtype_options(trained):
    """--dtype bfloat16 runs the target and the drafter in bf16 (recorded; on the CPU here, so no
    claim about speed or exactness), and unusable --device / --dtype values are one-line errors."""
    from pipeline.errors import PipelineError

    result = run_eval(EvalOptions(drafter=trained, target=None, prompts=None, max_new_tokens=8, block_size=None,
                                  tree_budget=[4], tree_top_k=4, limit=1, device="cpu",
                                  dtype="bfloat16"))
    assert result["device"] == "cpu (bfloat16)" and result["prompts"] == 1
    assert result["greedy"]["tokens"] > 0 and result["block"]["tokens"] > 0 and result["tree"]["4"]["tokens"] > 0
    batched = run_eval(EvalOptions(drafter=trained, target=None, prompts=None, max_new_tokens=16, block_size=None,
                                   tree_budget=[8], tree_top_k=4, limit=5, batch_size=3))
    assert batched["batch_size"] == 3 and batched["prompts"] == 5 and batched["lossless"]
    for device, dtype, verify, batch, message in (
            ("meta", "auto", "tree", 1, "--device: 'meta' is not supported"),
            ("cpu", "float16", "tree", 1, "--dtype: must be auto, float32 or bfloat16"),
            ("nonsense:0", "auto", "tree", 1, "--device: not a device"),
            ("cpu", "auto", "nodes", 1, "--tree-verify: must be one of tree, paths"),
            ("cpu", "auto", "tree", 0, "--batch-size must be >= 1"),
            ("cpu", "auto", "paths", 2, "--batch-size > 1 verifies each prompt's tree in one pass")):
        with pytest.raises(PipelineError, match=message):
            run_eval(EvalOptions(drafter=trained, target=None, prompts=None, max_new_tokens=4, block_size=None,
                                 tree_budget=[], tree_top_k=4, limit=1, device=device, dtype=dtype,
                                 tree_verify=verify, batch_size=batch))
    if not torch.cuda.is_available():
        with pytest.raises(PipelineError, match="--device cuda: no CUDA device is available here"):
            run_eval(EvalOptions(drafter=trained, target=None, prompts=None, max_new_tokens=4, block_size=None,
                                 tree_budget=[], tree_top_k=4, limit=1, device="cuda", dtype="auto"))


@pytest.mark.parametrize("window", [None, 6])
def test_the_drafter_kv_cache_drafts_what_the_full_recompute_drafts(trained, live, prompts, embedded, window):
    """Decoding with the drafter's KV cache (pipeline/drafter/incremental.py) against drafting
    over the whole context each step: the same draft tokens at every step, block and DDTree; with
    the trained weights as full-attention layers, and as sliding-window layers (W = 6, shorter
    than every prompt) so the cache's window is exercised."""
    import copy

    from pipeline.drafter.export import load_drafter
    from pipeline.eval.speculative_decoding import tree_decode

    embed, head = frozen_target_modules(embedded.TARGET_DIR)
    drafter = load_drafter(trained / "drafter", embed=embed, lm_head=head).eval()
    if window is not None:
        config = copy.deepcopy(drafter.config)
        config.layer_types, config.sliding_window = ["sliding_attention"] * config.num_hidden_layers, window
        sliding = DFlashDrafter(config, embed=embed, lm_head=head).eval()
        sliding.load_state_dict(drafter.state_dict())
        drafter = sliding
    steps = 0
    for p in prompts[:8]:
        cached = block_decode(live, drafter, p["ids"], max_new=48, eos=EOS)
        full = block_decode(live, drafter, p["ids"], max_new=48, eos=EOS, cached=False)
        assert cached.drafts == full.drafts and cached.tokens == full.tokens
        steps += len(cached.drafts)
    for p in prompts[8:11]:
        cached = tree_decode(live, drafter, p["ids"], max_new=32, eos=EOS, budget=16)
        full = tree_decode(live, drafter, p["ids"], max_new=32, eos=EOS, budget=16, cached=False)
        assert cached.drafts == full.drafts and cached.tokens == full.tokens
    assert steps > 20  # many steps compared, not a handful


def test_commit_from_the_verify_pass_equals_rerunning_the_accepted_tokens(live, prompts):
    """The state `commit` cuts out of a recorded verify pass (block: one row; DDTree: rows) equals
    the committed state rolled forward through the kept tokens by a second target pass (what
    decoding did before): same next-token logits and the same recurrent, conv and KV states, for
    every number of kept tokens."""
    prompt = prompts[5]["ids"]
    state = live.run(prompt, None, 0).state
    pos, tokens = len(prompt), [17, 230, 41, 9, 300, 77]
    rows = torch.tensor([tokens, [17, 5, 6, 7, 8, 9], [17, 230, 41, 2, 2, 2]])
    for keep in range(1, len(tokens) + 1):
        rerun = LiveTarget.copy(state)
        live.run(tokens[:keep], rerun, pos, with_hidden=False)
        block = live.commit(live.verify(tokens, LiveTarget.copy(state), pos), keep)
        tree = live.commit(live.verify_rows(rows, state, pos), keep, row=0)
        for got in (block, tree):
            for mine, theirs in zip(got.layers, rerun.layers):
                for name, value in vars(theirs).items():
                    if isinstance(value, torch.Tensor):
                        torch.testing.assert_close(getattr(mine, name), value, rtol=1e-4, atol=1e-5)
                    elif isinstance(value, dict) and value and isinstance(next(iter(value.values())), torch.Tensor):
                        for k, v in value.items():
                            torch.testing.assert_close(getattr(mine, name)[k], v, rtol=1e-4, atol=1e-5)
            nxt = live.run([3], got, pos + keep, with_hidden=False).logits
            torch.testing.assert_close(nxt, live.run([3], LiveTarget.copy(rerun), pos + keep, with_hidden=False).logits,
                                       rtol=1e-4, atol=1e-4)


def test_tree_verification_processes_each_node_once_and_equals_the_batched_paths(live, prompts):
    """`verify_tree` (one pass over the tree's nodes: ancestor mask + per-node recurrent states)
    against the batched root-to-leaf paths (each path an independent row continuing the same
    state, the plain way to verify a tree exactly): the same logits and tapped hidden states at
    every node; and the state `commit_path` keeps for a root path equals rolling the committed
    state forward through that path's tokens, for paths of every length in the tree."""
    generator = torch.Generator().manual_seed(3)
    prompt = prompts[7]["ids"]
    state = live.run(prompt, None, 0).state
    pos = len(prompt)
    logprobs = torch.log_softmax(3 * torch.randn(7, 512, generator=generator), dim=-1)
    tree = build_tree(logprobs, 64, 8)
    tokens, parents = [17, *tree.tokens], [-1, *(p + 1 for p in tree.parents)]
    paths = tree.paths()
    width = max(len(p) for p in paths)
    rows = torch.tensor([[17] + [tree.tokens[n] for n in p] + [17] * (width - len(p)) for p in paths])
    before = live.tokens
    verified = live.verify_tree(tokens, parents, LiveTarget.copy(state), pos)
    assert live.tokens - before == 65  # each node once, the root included
    by_rows = live.verify_rows(rows, LiveTarget.copy(state), pos).step
    assert rows.numel() > 2 * 65       # what the batched paths process instead
    for r, p in enumerate(paths):
        index = [0, *(n + 1 for n in p)]
        torch.testing.assert_close(verified.step.logits[index], by_rows.logits[r, :len(index)], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(verified.step.hidden[index], by_rows.hidden[r, :len(index)], rtol=1e-4, atol=1e-4)
    lengths = sorted({len(p) for p in paths})
    assert len(lengths) >= 3, lengths
    for length in lengths:
        p = next(p for p in paths if len(p) == length)
        for keep in range(length + 1):   # the root alone, then one more node each time
            path = [0, *(n + 1 for n in p[:keep])]
            committed = live.commit_path(live.verify_tree(tokens, parents, LiveTarget.copy(state), pos), path)
            rerun = LiveTarget.copy(state)
            live.run([tokens[i] for i in path], rerun, pos, with_hidden=False)
            for mine, theirs in zip(committed.layers, rerun.layers):
                for name in ("keys", "values", "conv_states", "recurrent_states"):
                    value = getattr(theirs, name, None)
                    for k, v in (value.items() if isinstance(value, dict) else [(None, value)] if value is not None else []):
                        got = getattr(mine, name) if k is None else getattr(mine, name)[k]
                        torch.testing.assert_close(got, v, rtol=1e-4, atol=1e-5)
            nxt = live.run([3], committed, pos + len(path), with_hidden=False).logits
            torch.testing.assert_close(nxt, live.run([3], rerun, pos + len(path), with_hidden=False).logits,
                                       rtol=1e-4, atol=1e-4)


def test_tree_and_paths_verification_decode_the_same_tokens(trained, live, prompts, embedded):
    from pipeline.drafter.export import load_drafter
    from pipeline.eval.speculative_decoding import tree_decode

    embed, head = frozen_target_modules(embedded.TARGET_DIR)
    drafter = load_drafter(trained / "drafter", embed=embed, lm_head=head).eval()
    accepted = 0
    for p in prompts[20:24]:
        reference = greedy(live, p["ids"], max_new=48, eos=EOS).tokens
        for budget in (16, 64):
            tree = tree_decode(live, drafter, p["ids"], max_new=48, eos=EOS, budget=budget)
            paths = tree_decode(live, drafter, p["ids"], max_new=48, eos=EOS, budget=budget, verify="paths")
            assert tree.tokens == paths.tokens == reference and tree.accepted == paths.accepted
            accepted += sum(tree.accepted)
    assert accepted > 30  # the walk goes down the tree, not only the root


def test_odd_prompts_decode_losslessly(trained, tmp_path):
    """Empty, one-character, whitespace, very long (about 1,250 tokens), emoji / CJK / RTL /
    combining marks, special-token look-alikes, control characters, tool-call history: block and
    DDTree 16 / 64 equal greedy on every one."""
    from pipeline.eval.odd_prompts import odd_conversations

    rows = odd_conversations(long_words=300)   # ~1,250 tokens here (the benchmark's set: ~2,900)
    path = tmp_path / "odd.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    # The tree pass named: auto would pick the paths on this small target, and the pass is what is checked.
    result = run_eval(EvalOptions(drafter=trained, target=None, prompts=path, max_new_tokens=20, block_size=None,
                                  tree_budget=[16, 64], tree_top_k=8, limit=None, tree_verify="tree"))
    assert result["prompts"] == len(rows) >= 12
    assert result["lossless"], (result["block"]["mismatches"], {b: t["mismatches"] for b, t in result["tree"].items()})
    assert result["greedy"]["tokens"] > 4 * len(rows)  # most prompts decode more than a token or two
    assert result["tree"]["64"]["target_tokens_per_verify"] == 65.0  # every node once, the root included


def test_batched_decoding_equals_one_prompt_at_a_time(trained, live, prompts, embedded):
    """`decode_rows` (several prompts per verify pass: rows of different committed lengths, trees
    of different shapes, finished prompts leaving the batch) against the single-prompt decoders:
    the same drafts, the same accepted tokens at every step, the same output, for block and
    DDTree 16 / 64; and one target pass per step for the whole batch."""
    from pipeline.drafter.export import load_drafter
    from pipeline.eval.batched import decode_rows
    from pipeline.eval.speculative_decoding import tree_decode

    embed, head = frozen_target_modules(embedded.TARGET_DIR)
    drafter = load_drafter(trained / "drafter", embed=embed, lm_head=head).eval()
    batch = [p["ids"] for p in prompts[30:35]] + [prompts[0]["ids"] * 3]   # lengths differ; one long
    assert len({len(ids) for ids in batch}) > 3
    reference = [greedy(live, ids, max_new=32, eos=EOS).tokens for ids in batch]
    for budget in (None, 16, 64):
        single = [block_decode(live, drafter, ids, max_new=32, eos=EOS) if budget is None
                  else tree_decode(live, drafter, ids, max_new=32, eos=EOS, budget=budget) for ids in batch]
        before = live.passes
        rows = decode_rows(live, drafter, batch, max_new=32, eos=EOS, budget=budget)
        assert live.passes - before == len(batch) + max(r.verify_passes for r in rows)  # prefills + shared steps
        assert len({r.verify_passes for r in rows}) > 1                                  # prompts finished apart
        for one, many, tokens in zip(single, rows, reference, strict=True):
            assert many.drafts == one.drafts and many.accepted == one.accepted and many.tokens == one.tokens
            assert many.tokens == tokens


def test_plain_decoding_of_a_batch_equals_one_prompt_at_a_time(live, prompts):
    """`greedy_rows` (eval's reference at --batch-size > 1) against `greedy` prompt by prompt:
    rows of different lengths, a repeated prompt, prompts finishing apart; greedy and sampled
    (each prompt's random numbers keyed by its own index, not its place in the batch); one target
    pass per step for the whole batch."""
    from pipeline.eval.speculative_decoding import greedy_rows
    from pipeline.eval.speculative_sampling import SpeculativeSampler

    batch = [p["ids"] for p in prompts[40:45]] + [prompts[40]["ids"]]
    assert len({len(ids) for ids in batch}) > 3
    row_ids = [7, 3, 11, 0, 5, 9]
    for sampling in (None, SpeculativeSampler(temperature=1.0, top_p=0.9, seed=4)):
        alone = [greedy(live, ids, max_new=24, eos=EOS, sampling=sampling, row=i) for ids, i in zip(batch, row_ids)]
        before = live.passes
        together = greedy_rows(live, batch, max_new=24, eos=EOS, sampling=sampling, row_ids=row_ids)
        assert [r.tokens for r in together] == [r.tokens for r in alone]
        assert [r.target_passes for r in together] == [r.target_passes for r in alone]
        assert len({len(r.tokens) for r in alone}) > 1                       # prompts finished apart
        assert live.passes - before == (len(batch) - 1) + max(r.target_passes - 1 for r in alone)  # prefills (one repeated) + shared steps


def test_eval_progress_is_plain_lines_in_a_log(trained, capsys):
    """Not a terminal (a log file, CI): eval's progress is plain lines (prompts done / total,
    prompts/s, tokens/s, the running block tau), not a bar that only renders at the end."""
    from pipeline.ui import ProgressBar

    with ProgressBar("eval", "prompts", total=4, enabled=True, every_percent=25, min_interval_s=0) as bar:
        result = run_eval(EvalOptions(drafter=trained, target=None, prompts=None, max_new_tokens=32, block_size=None,
                                      tree_budget=[], tree_top_k=8, limit=4), progress=bar.advance)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("eval: ")]
    assert [x.split()[1] for x in lines] == ["1/4", "2/4", "3/4", "4/4"], lines
    assert all("prompts/s" in x and "tok/s" in x and "block tau " in x for x in lines), lines
    final_tau = float(lines[-1].split("block tau ")[1].split()[0])
    assert final_tau == pytest.approx(result["block"]["tau_pooled"], abs=0.005)
    assert "eta 0:00:00" in lines[-1]


def test_tree_verify_auto_follows_its_rule():
    """The rule, spelled out: several prompts per pass need the tree pass; a target that takes no
    mask needs the paths; otherwise the size decides (20 M non-embedding parameters)."""
    from pipeline.eval.speculative_decoding import choose_tree_verify

    assert choose_tree_verify(1_700_000, batch_size=1, takes_mask=True)[0] == "paths"
    assert choose_tree_verify(229_000_000, batch_size=1, takes_mask=True)[0] == "tree"
    assert choose_tree_verify(20_000_000, batch_size=1, takes_mask=True)[0] == "tree"
    assert choose_tree_verify(19_999_999, batch_size=1, takes_mask=True)[0] == "paths"
    assert choose_tree_verify(1_700_000, batch_size=8, takes_mask=True)[0] == "tree"
    assert choose_tree_verify(1_700_000, batch_size=2, takes_mask=False)[0] == "tree"   # from two prompts a pass
    assert choose_tree_verify(229_000_000, batch_size=1, takes_mask=False)[0] == "paths"
    assert choose_tree_verify(1_700_000, batch_size=1, takes_mask=True)[1] == (
        "1.7 M non-embedding parameters < 20 M: per-layer call overhead dominates")
    assert choose_tree_verify(229_000_000, batch_size=1, takes_mask=True)[1] == (
        "229.0 M non-embedding parameters >= 20 M: the target's compute dominates")


def test_eval_figures_reach_the_training_runs_tracker(trained, tmp_path):
    """`eval --report-to tensorboard`: the taus land in the run's TensorBoard files as eval/... at
    the training's last step, read back with TensorBoard's own reader."""
    importable("tensorboard", "the test extra installs the trackers")
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    shutil.copytree(trained, run)  # the module's run stays as it was for the other tests
    result = run_eval(EvalOptions(drafter=run, target=None, prompts=None, max_new_tokens=24, block_size=None,
                                  tree_budget=[4], tree_top_k=4, limit=2, report_to="tensorboard"))
    last_step = json.loads((run / "train_log.jsonl").read_text().splitlines()[-1])["step"]
    assert result["reported_to"] == {"trackers": ["tensorboard"], "at_step": last_step}
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    found = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert found["eval/block_tau_pooled"] == [(last_step, pytest.approx(result["block"]["tau_pooled"], rel=1e-6))]
    assert found["eval/ddtree4_tau_pooled"] == [(last_step, pytest.approx(result["tree"]["4"]["tau_pooled"], rel=1e-6))]
    with pytest.raises(PipelineError, match="training run"):
        lone = tmp_path / "lone"
        shutil.copytree(run / "drafter", lone)
        run_eval(EvalOptions(drafter=lone, target=None, prompts=None, max_new_tokens=8, block_size=None,
                             tree_budget=[], tree_top_k=4, limit=1, report_to="tensorboard"))
