"""The live target during speculative decoding: its cache, its tapped hidden states, and exact rollback.

Gated DeltaNet layers keep a recurrent state that only moves forward: after verifying B draft
tokens, cropping the KV cache of the attention layers does not bring the recurrent state back
to the last accepted token. So a block verification (`verify`, `verify_rows`) records what a
rollback needs: transformers' cache keeps the conv inputs of every verified position
(`internals.start_recording`), and the gated delta rule's state after each verified position is
kept (the chunked rule gives only the last; `tree_internals.recording_states` runs the single-step rule over
the few verified tokens instead). `commit`
then crops the cache to the accepted tokens and sets each recurrent state to the one after the
last accepted token: no second target pass (tested against re-running the accepted tokens on
the committed state, which is what decoding did before).

A draft tree is verified in one pass over its nodes (`verify_tree`): the attention layers take
an ancestor mask over the committed cache plus the tree, and the Gated DeltaNet layers run as a
tree (`tree_internals.tree_rules`: each node's conv window is its ancestors' inputs, its recurrent state is
stepped from its parent's). `commit_path` keeps the accepted path's keys/values, conv inputs
and last recurrent state. Tested against `verify_rows` over the tree's root-to-leaf paths.

The speculative decoder touches transformers' internals (the cache's layers and their states,
the qwen3_5 modeling module's conv and gated delta rule functions, the attention mask the forward
takes per layer kind) only through the internals package (internals/, its tree.py);
tests/target_model/test_transformers_internals.py names each one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from pipeline.target_model import internals
from pipeline.target_model.internals import tree as tree_internals
from pipeline.target_model.capture import tapped_layers


@dataclass
class Step:
    logits: torch.Tensor    # [L, V] (or [R, L, V] for batched rows; [1, V] for a `last_only` run), float32
    hidden: torch.Tensor | None  # [L, n, H] tapped hidden states (hidden_states[i + 1]) in the model's dtype; None unless asked for
    state: object           # the cache after these tokens


class LiveTarget:
    def __init__(self, model, taps: list[int]):
        self.model, self.taps = model.eval(), list(taps)
        self.device = next(model.parameters()).device
        self.passes = 0       # target forward passes, all kinds
        self.tokens = 0       # tokens fed through the target

    @torch.no_grad()
    def run(self, tokens: list[int] | torch.Tensor, state, start: int, *, with_hidden: bool = True,
            last_only: bool = False) -> Step:
        """Feed `tokens` at positions start.. on top of `state` (None: empty). `state` is updated
        in place by transformers; pass a copy to keep the original. `last_only`: logits for the
        last token alone (a prefill: the only one decoding reads; the lm_head over every prompt
        token would hold prompt x vocabulary floats, about 1 MB a token at Qwen's 248k vocab)."""
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1).to(self.device)
        positions = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        with self.tapped(with_hidden) as taps:
            out, state = internals.forward_with_cache(self.model, state, input_ids=ids, position_ids=positions, use_cache=True,
                                                      logits_to_keep=1 if last_only else 0)
        self.passes += 1
        self.tokens += ids.shape[1]
        return Step(out.logits[0].float(), taps.stacked()[0] if with_hidden else None, state)

    def tapped(self, enabled: bool = True):
        """The tapped layers' outputs during a forward (pipeline/target_model/capture.py `tapped_layers`)."""
        return tapped_layers(self.model, self.taps, enabled)

    @torch.no_grad()
    def verify(self, tokens: list[int], state, start: int, *, with_hidden: bool = True) -> Verified:
        """`run` with `state` recording: `commit` can then keep any prefix of `tokens`. `state` is
        consumed (no copy of the whole cache per step; the committed state comes from `commit`)."""
        internals.start_recording(state)
        with tree_internals.recording_states() as states:
            step = self.run(tokens, state, start, with_hidden=with_hidden)
        return Verified(step, len(tokens), states)

    @torch.no_grad()
    def verify_rows(self, rows: torch.Tensor, state, start: int) -> Verified:
        """Logits [R, L, V] and tapped hidden states [R, L, n, H] for R token rows of equal length,
        each continuing `state` (tree verification as batched root-to-leaf paths: one target
        pass), on a recording copy; `commit` keeps a prefix of one row."""
        rows = rows.to(self.device)
        recording = internals.repeat_state(state, rows.shape[0])   # a copy already
        internals.start_recording(recording)
        positions = torch.arange(start, start + rows.shape[1], device=self.device)[None].expand(rows.shape[0], -1)
        with tree_internals.recording_states() as states, self.tapped() as taps:
            out, recording = internals.forward_with_cache(self.model, recording, input_ids=rows, position_ids=positions,
                                                          use_cache=True)
        self.passes += 1
        self.tokens += rows.numel()
        hidden = taps.stacked()   # [R, L, n, H]
        return Verified(Step(out.logits.float(), hidden, recording), rows.shape[1], states)

    @staticmethod
    def commit(verified: Verified, keep: int, row: int | None = None):
        """The state after the first `keep` verified tokens (of `row` for `verify_rows`), from
        the verify pass alone. The verified state is consumed."""
        state = verified.step.state
        internals.keep_prefix(state, verified.length, keep, verified.states)
        if row is not None:
            internals.select_row(state, row)
        return state

    @torch.no_grad()
    def verify_tree(self, tokens: list[int], parents: list[int], state, start: int) -> TreeVerified:
        """One target pass over a token tree continuing `state`, each token processed once.
        tokens[0] is the root (at position `start`), parents[i] < i is token i's parent (-1 for
        the root). Full-attention layers see the committed cache plus the token's ancestors
        (an ancestor mask); linear-attention layers start each token from its parent's
        recurrent state and convolve over its ancestors' inputs (`tree_internals.tree_rules`).
        Logits [N, V] and tapped hidden states [N, n, H] per token; `commit_path` keeps one root
        path. `state` is consumed (the committed state comes from `commit_path`)."""
        verified = self.verify_trees([tokens], [parents], Rows(state, None, [start]))
        return TreeVerified(Step(verified.step.logits[0], verified.step.hidden[0], verified.step.state),
                            verified.length, verified.states, verified.rows)

    @torch.no_grad()
    def verify_trees(self, tokens: list[list[int]], parents: list[list[int]], rows: Rows) -> TreeVerified:
        """`verify_tree` for several sequences at once: row b of `rows` continues with the tree
        (tokens[b], parents[b]); every tree has the same number of tokens. Logits [B, N, V],
        tapped hidden states [B, N, n, H]; `commit_paths` keeps one root path per row."""
        count, n = len(tokens), len(tokens[0])
        for t, p in zip(tokens, parents):
            if len(t) != n or len(p) != n or p[0] != -1 or any(not 0 <= p[i] < i for i in range(1, n)):
                raise ValueError("trees: the same number of tokens in each; parents: the root first (-1), "
                                 "then each token after its parent")
        ancestry = torch.eye(n, dtype=torch.bool).repeat(count, 1, 1)
        depth = torch.zeros(count, n, dtype=torch.long)
        for b, p in enumerate(parents):
            for i in range(1, n):
                ancestry[b, i] |= ancestry[b, p[i]]
                depth[b, i] = depth[b, p[i]] + 1
        # Which slots are real is host bookkeeping (`Rows.valid`), as the trees' shapes are: the
        # mask is built on the host and uploaded, nothing is read back.
        committed = rows.valid if rows.valid is not None else torch.ones(count, rows.starts[0], dtype=torch.bool)
        visible = torch.cat([committed[:, None, :].expand(-1, n, -1), ancestry], dim=2)[:, None].to(self.device)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        positions = (torch.tensor(rows.starts)[:, None] + depth).to(self.device)
        internals.start_recording(rows.state)   # the conv inputs of every tree token stay until commit_paths
        with tree_internals.tree_rules(parents) as inputs, self.tapped() as taps:
            out, state = internals.forward_with_cache(self.model, rows.state, input_ids=ids, position_ids=positions,
                                                      use_cache=True, attention_mask=internals.attention_masks(self.model, visible))
        self.passes += 1
        self.tokens += count * n
        hidden = taps.stacked()
        return TreeVerified(Step(out.logits.float(), hidden, state), n, inputs, rows)

    @staticmethod
    def commit_path(verified: TreeVerified, path: list[int]):
        """The state after the tree tokens `path` (the root, then each next one a child of the one
        before), from the tree pass alone: the path's keys/values and conv inputs are kept, each
        recurrent state is the one after the path's last token."""
        return LiveTarget.commit_paths(verified, [path]).state

    @staticmethod
    def commit_paths(verified: TreeVerified, paths: list[list[int]]) -> Rows:
        """`commit_path` for each row of `verify_trees`; the rows move on by their paths' lengths."""
        valid = tree_internals.keep_path(verified.step.state, verified.length, paths, verified.states, verified.rows.valid)
        return Rows(verified.step.state, valid, [s + len(p) for s, p in zip(verified.rows.starts, paths)])

    @torch.no_grad()
    def prefill_rows(self, prompts: list[list[int]], *, with_hidden: bool = True) -> tuple[Rows, list[Step]]:
        """Each prompt prefilled on its own (no padding inside the target's pass), then their
        caches stacked into rows; the per-prompt steps carry the last token's logits [1, V] and
        every prompt token's tapped hidden states. A prompt repeated in the batch (several samples
        of one prompt) is prefilled once; its rows start from copies of that one state."""
        once: dict[tuple[int, ...], Step] = {}
        for p in prompts:
            if tuple(p) not in once:
                once[tuple(p)] = self.run(p, None, 0, with_hidden=with_hidden, last_only=True)
        steps = [once[tuple(p)] for p in prompts]
        state, valid = internals.stack_rows([s.state for s in steps], [len(p) for p in prompts])
        return Rows(state, valid, [len(p) for p in prompts]), steps

    @torch.no_grad()
    def step_rows(self, tokens: list[int], rows: Rows) -> tuple[torch.Tensor, Rows]:
        """One token per row (a decode step for several sequences at once): logits [B, V] and the
        rows moved on by one."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        positions = torch.tensor(rows.starts, device=self.device)[:, None]
        valid, mask = None, None
        if rows.valid is not None:
            valid = torch.cat([rows.valid, torch.ones(len(tokens), 1, dtype=torch.bool, device=rows.valid.device)], dim=1)
            mask = internals.attention_masks(self.model, valid[:, None, None, :].to(self.device))
        out, state = internals.forward_with_cache(self.model, rows.state, input_ids=ids, position_ids=positions, use_cache=True,
                                                  attention_mask=mask)
        self.passes += 1
        self.tokens += len(tokens)
        return out.logits[:, -1].float(), Rows(state, valid, [s + 1 for s in rows.starts])

    @staticmethod
    def keep_rows(rows: Rows, keep: list[int]) -> Rows:
        """Only rows `keep` (finished sequences leave the batch)."""
        valid = internals.keep_rows(rows.state, keep, rows.valid)
        return Rows(rows.state, valid, [rows.starts[i] for i in keep])

    @staticmethod
    def copy(state):
        return copy.deepcopy(state)


@dataclass
class Verified:
    step: Step
    length: int                        # tokens verified (per row)
    states: list[list[torch.Tensor]]   # per linear-attention layer, its recurrent state after each verified token


@dataclass
class Rows:
    """Several sequences continuing in one batched cache. Their lengths differ, so the attention
    layers' key/value slots of row b are real where valid[b] (None: all real); `starts[b]` is row
    b's next position. `valid` lives on the host (it follows from lengths and paths the host
    knows): reading it costs no device sync; passes upload it as their mask."""
    state: object
    valid: torch.Tensor | None
    starts: list[int]


@dataclass
class TreeVerified:
    step: Step
    length: int                                     # tree tokens per row, the root included
    states: list[tree_internals.TreeStepInputs]          # per linear-attention layer, its step inputs
    rows: Rows                                      # what the trees continued

