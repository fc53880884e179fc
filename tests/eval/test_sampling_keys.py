"""Speculative sampling's rule and its keyed numbers, checked without a model in milliseconds.

The distribution tests (test_sampling.py) show the output is distributed as plain sampling's; they
cannot see a number keyed to the wrong position, which only correlates a draw with the history
(a draft or an acceptance test reusing a number an earlier token depended on). The rule checked
here is the module's: every number is keyed by (seed, prompt, position, purpose), so the same
position gives the same number whichever step, slot or chain length reaches it, and a bonus token
is the target's own draw at its position (`pick`, plain sampling's draw).
"""

import torch

from pipeline.eval.speculative_sampling import LosslessRule, SpeculativeSampler, target_tokens

ROW = 3
V = 8
# The target gives draft token 0 probability 0.4 where the drafter gives it 0.8: each draft is
# accepted with probability 0.5, so a chain stops at a place the numbers decide.
P = torch.tensor([0.4] + [0.6 / (V - 1)] * (V - 1))
Q = torch.tensor([0.8] + [0.2 / (V - 1)] * (V - 1))
POSITIONS = range(11, 71)


def sampler() -> SpeculativeSampler:
    return SpeculativeSampler(temperature=1.0, seed=7)


def chain(s: SpeculativeSampler, pos: int, n_drafts: int) -> tuple[int, int]:
    """accept_chain over n_drafts drafts of token 0 (positions pos+1..), q and p as above."""
    target_logits = P.log().expand(n_drafts + 1, V)
    return s.accept_chain(ROW, pos, [0] * n_drafts, Q.expand(n_drafts, V), target_logits)


def test_a_token_the_target_forbids_is_never_accepted_and_acceptance_is_u_below_p_over_q():
    rule = LosslessRule()
    assert not rule.accepts(0.0, 0.5, 0.0)          # p(x) = 0: rejected even at u = 0
    # Accept iff u < p/q: with u uniform on [0, 1) that has probability p/q exactly.
    assert not rule.accepts(0.25, 0.5, 0.5)
    assert rule.accepts(0.25, 0.5, 0.5 - 2.0 ** -53)
    assert rule.accepts(0.5, 0.5, 1 - 2.0 ** -53)   # p >= q: always accepted


def test_the_residual_is_max_of_p_minus_q_and_p_itself_when_that_is_all_zero():
    rule = LosslessRule()
    assert torch.equal(rule.residual(P, Q), (P - Q).clamp_min(0))
    # p == q: rejection has probability 0, and a residual of zeros would draw the last token.
    assert torch.equal(rule.residual(P, P.clone()), P)


def test_a_draft_is_keyed_by_its_position_whichever_step_drafts_it():
    s = sampler()
    logits = torch.zeros(4, 1000)       # every slot's q uniform over 1,000 tokens
    single = {j: s.draft_chain(ROW, j - 1, logits[:1])[0][0] for j in range(11, 80)}
    assert len(set(single.values())) > 50          # different positions, different numbers
    for pos in range(10, 75):
        drafts, q = s.draft_chain(ROW, pos, logits)
        assert drafts == [single[pos + 1 + k] for k in range(4)], pos
        assert torch.equal(q, torch.full((4, 1000), 1e-3))


def test_the_acceptance_test_residual_and_bonus_are_keyed_by_position():
    """A chain of four drafts from `pos` stops where a one-draft chain at that position would reject,
    emits the residual token that chain emits, and when all four pass, emits the target's own draw
    at pos+5."""
    s = sampler()
    single = {j: chain(s, j - 1, 1) for j in range(11, 80)}
    outcomes = {n for n, _ in single.values()}
    assert outcomes == {0, 1}
    for j, (n, token) in single.items():
        if n == 1:
            assert token == s.pick(ROW, j + 1, P.log())
        else:
            assert token != 0                       # the residual has no mass on the draft
    stops = []
    for pos in POSITIONS:
        n, token = chain(s, pos, 4)
        expected_n = next((k for k in range(4) if single[pos + 1 + k][0] == 0), 4)
        assert n == expected_n, pos
        expected_token = s.pick(ROW, pos + 5, P.log()) if n == 4 else single[pos + 1 + n][1]
        assert token == expected_token, pos
        stops.append(n)
    assert len(set(stops)) >= 4                    # the chains stopped at several slots, some ran through
    assert 4 in stops


def test_with_no_drafts_the_token_is_the_target_draw_at_the_next_position():
    s = sampler()
    for pos in POSITIONS:
        assert chain(s, pos, 0) == (0, s.pick(ROW, pos + 1, P.log()))


def test_target_tokens_are_the_argmax_of_each_row_or_its_keyed_draw():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    rows = logits.tolist()
    assert target_tokens(logits, iter(()), None) == [r.index(max(r)) for r in rows]
    s = sampler()
    keys = [(0, 12), (1, 12), (0, 13)]
    assert target_tokens(logits, keys, s) == [s.pick(r, p, logits[n]) for n, (r, p) in enumerate(keys)]


def test_a_ddtree_node_gets_the_targets_draw_at_its_position():
    """The token after a node at depth d of a step from `pos` is the target's own draw at position
    pos + 1 + d (as a bonus token and plain sampling draw there); greedy, the argmax."""
    from pipeline.eval.speculative_decoding import Chooser

    s = sampler()
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    depths = [0, 1, 1, 2, 3]
    assert Chooser(s, ROW, 20).many(logits, depths) == [s.pick(ROW, 21 + d, logits[i]) for i, d in enumerate(depths)]
    assert Chooser(None, ROW, 20).many(logits, depths) == logits.argmax(-1).tolist()
