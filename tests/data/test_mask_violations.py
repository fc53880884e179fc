"""The stored mask's rule check (`mask_violations`, run by verify-cache's mask_boundaries) on
hand-made Qwen-style tokens: a toy vocabulary whose pieces are given, so every position below is
worked by hand."""

import numpy as np
import pytest

from pipeline.data.loss_mask import mask_violations

PIECES = ["<|im_start|>", "<|im_end|>", "\n", "user", "assistant", "system", "hi", "x", "\nh"]
START, END, NL, USER, ASSISTANT, SYSTEM, HI, X, NL_H = range(len(PIECES))
NEWLINE = np.array(["\n" in p for p in PIECES])
# turns: system 0-4, user 6-10, assistant 12-17; the newlines 5, 11 and 18 lie between turns
TOKENS = [START, SYSTEM, NL, HI, END, NL, START, USER, NL, HI, END, NL, START, ASSISTANT, NL, X, X, END, NL]
RULE = [0] * 15 + [1, 1, 1, 0]


def violations(tokens, mask):
    return mask_violations(tokens, mask, turn_start=START, end_of_turn=END, newline=NEWLINE,
                           decode=lambda ids: "".join(PIECES[i] for i in ids))


def planted(*changes):
    mask = list(RULE)
    for pos, value in changes:
        mask[pos] = value
    return mask


def test_a_mask_that_obeys_the_rule_has_no_violation():
    assert violations(TOKENS, RULE) == {}
    # an assistant turn first (its role read from the tokens after position 0)
    assert violations(TOKENS[12:], RULE[12:]) == {}


@pytest.mark.parametrize("changes,found", [
    ([(13, 1)], {"assistant header supervised": 13}),
    ([(14, 1), (15, 0), (16, 0), (17, 0)], {"assistant header supervised": 14}),   # the header alone
    ([(10, 1)], {"user turn supervised": 10}),                     # the turn's own end of turn
    ([(14, 1)], {"assistant header supervised": 14}),              # the header's own newline
    ([(8, 1)], {"user header supervised": 8}),
    ([(9, 1)], {"user turn supervised": 9}),                       # the turn's first token
    ([(3, 1), (9, 1)], {"system turn supervised": 3, "user turn supervised": 9}),
    ([(17, 0)], {"end-of-turn token not supervised": 17}),
    ([(18, 1)], {"supervised token outside any turn": 18}),
    ([(5, 1), (18, 1)], {"supervised token outside any turn": 5}),  # the first of two
    ([(13, 1), (14, 1)], {"assistant header supervised": 13}),     # the first of two in one turn
])
def test_each_violation_is_named_at_its_first_position(changes, found):
    assert violations(TOKENS, planted(*changes)) == found


def test_a_header_token_that_carries_generated_text_follows_the_straddling_rule():
    # "<|im_start|>assistant" then "\nh": the newline ends the header, the "h" after it is generated
    tokens = [START, USER, NL, HI, END, NL, START, ASSISTANT, NL_H, X, END]
    assert violations(tokens, [0] * 8 + [1, 1, 1]) == {}
    assert violations(tokens, [0] * 7 + [1, 1, 1, 1]) == {"assistant header supervised": 7}


def test_a_one_token_answer_without_its_end_of_turn_is_named():
    tokens = [START, USER, NL, HI, END, NL, START, ASSISTANT, NL, X, END]
    assert violations(tokens, [0] * 9 + [1, 1]) == {}
    assert violations(tokens, [0] * 9 + [1, 0]) == {"end-of-turn token not supervised": 10}


@pytest.mark.parametrize("cut", [14, 15, 16])
def test_a_sample_truncated_in_a_header_or_a_turn_is_judged_on_what_it_holds(cut):
    # max_length cuts the assistant turn inside its header (no newline follows its role), right
    # after the header's newline, or inside the answer (no end of turn follows)
    assert violations(TOKENS[:cut], RULE[:cut]) == {}
    assert violations(TOKENS[:cut], planted((13, 1))[:cut]) == {"assistant header supervised": 13}


def test_a_sample_cut_right_after_a_turn_start_names_that_start_supervised():
    # the role is cut off, so the header is named with an empty role
    assert violations(TOKENS[:13], planted((12, 1))[:13]) == {" header supervised": 12}


def test_an_answer_that_the_next_turn_interrupts_is_named():
    # a pre-tokenized row: the assistant turn has no end of turn before the next turn starts
    tokens = [START, USER, NL, HI, END, NL, START, ASSISTANT, NL, X, NL, START, USER, NL, HI, END]
    mask = [0] * 9 + [1, 1] + [0] * 5
    assert violations(tokens, mask) == {"assistant turn not closed by the end-of-turn token": 11}
    # its first token alone supervised: still named; its header alone: a header violation only
    assert violations(tokens, [0] * 9 + [1] + [0] * 6) == {"assistant turn not closed by the end-of-turn token": 11}
    assert violations(tokens, [0] * 8 + [1] + [0] * 7) == {"assistant header supervised": 8}


def test_an_empty_turn_closes_at_the_end_of_turn_right_after_its_header():
    # an empty assistant turn (its end-of-turn supervised), then a user turn
    tokens = [START, ASSISTANT, NL, END, NL, START, USER, NL, HI, END]
    assert violations(tokens, [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]) == {}
    assert violations(tokens, [0, 0, 0, 1, 1, 0, 0, 0, 0, 0]) == {"supervised token outside any turn": 4}
