"""The drafter's shape: sizes, the target layers it taps, its block, and each layer's kind
(`full_attention` or `sliding_attention` with window `sliding_window`; what the kinds mean is
pipeline/drafter/model.py's docstring). Checked when built, so a bad config fails here, not in
the middle of a forward. The block size is checked here only (`check_block_size`): as built, and
where eval drafts a shorter block than the trained one (`DrafterConfig.at_block`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


FULL, SLIDING = "full_attention", "sliding_attention"


def check_block_size(block_size: int, *, trained: int | None = None, name: str = "block_size") -> None:
    """The one rule for a drafter's block: the anchor and at least one draft slot, and (run at
    another block than its own) no more slots than it was `trained` on. `name`: the setting as
    its user spells it (eval's `--block-size`). ValueError, as every config check here."""
    if trained is None and block_size < 2:
        raise ValueError(f"{name} must be >= 2 (the anchor and a draft slot), got {block_size}")
    if trained is not None and not 2 <= block_size <= trained:
        raise ValueError(f"{name} must be in 2..{trained} (the block this drafter was trained on), got {block_size}")


@dataclass(kw_only=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    layer_types: list[str] | None = None    # None: every layer "full_attention"
    sliding_window: int | None = None        # W of the "sliding_attention" layers
    draft_vocab_size: int | None = None      # K of a draft vocabulary (DESIGN 3.4); None: the target's whole vocabulary
    # The mask token as the target's tokenizer spells it (None: a row past its vocabulary), for
    # serving engines that look the id up by it (SGLang). Not compared: the id is what the drafter
    # computes with, and a checkpoint exported before the text was recorded still resumes.
    mask_token: str | None = field(default=None, compare=False)
    # R of a projected cache (pipeline/projection/basis.py): fc reads the taps' R projected values
    # instead of n_taps * hidden_size. Training only: the export folds the basis into fc and
    # writes a drafter on the full taps, without it. None: the full taps.
    projected_rank: int | None = None
    # How fc' reads a projected row z (stored at unit RMS a component, so one fp8 scale fits):
    # True, at each component's pilot RMS (z * s = P x, the taps' own energy), with fc' initialised
    # as a whole-tap fc restricted to the basis, so AdamW moves each direction as on whole taps;
    # False, z as stored (the first form, which amplified the low-energy directions by 1/s: a tau
    # gap, BENCHMARKS "Energy and tau by R"). Read from an export without it: False.
    projected_energy: bool = False

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"layer_types: unknown kind {unknown[0]!r} (expected {FULL!r} or {SLIDING!r})")
        if SLIDING in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window}")
        if SLIDING not in self.layer_types:
            # A window with no sliding layer means nothing, and the export does not write one: kept,
            # it made a checkpoint of such a drafter differ from its own run's config, so resuming
            # it was refused (found by the flagship rehearsal's one-layer drafter).
            self.sliding_window = None
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        check_block_size(self.block_size)
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}] (vocab_size), got {self.draft_vocab_size}")
        taps = len(self.target_layer_ids) * self.hidden_size
        if self.projected_rank is not None and not 1 <= self.projected_rank < taps:
            raise ValueError(f"projected_rank must be in [1, {taps}) (n_taps x hidden_size), got {self.projected_rank}")
        if self.projected_energy and self.projected_rank is None:
            raise ValueError("projected_energy needs projected_rank (a projected cache's R)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary")

    def at_block(self, block_size: int, *, name: str = "block_size") -> DrafterConfig:
        """This drafter drafting blocks of `block_size`: a new config, this one left as trained.
        Slot k was trained to predict the token k ahead of the anchor, so a block may be cut
        short, never grown. `name`: as in `check_block_size`."""
        check_block_size(block_size, trained=self.block_size, name=name)
        return replace(self, block_size=block_size)   # __post_init__ checks the new config again

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None
