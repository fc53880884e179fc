"""`pipeline train`'s settings, one dataclass a component (torchtitan's JobConfig is the model):
each component is a TOML table, each of its option fields a flat flag of `pipeline train`, and
each training module takes only the component(s) it reads. Field names are unique across the
components, so a flag, an old flat TOML key and a recorded setting each name one field.

Defaults are DESIGN's (block 16, 512 anchors, gamma by block size); a preset (`presets/NAME.toml`)
supplies a whole recipe in the same tables. How the layers are merged is pipeline/config/tables.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipeline.errors import PipelineError
from pipeline.config.fields import float_list, int_list, option, parse_size, refuse_failed, text_list, token_or_id

# The trackers `report_to` may name; pipeline/tracking owns what each one is (its backends) and
# tests/report/test_tracking.py holds the two lists equal.
TRACKER_NAMES = ("tensorboard", "wandb", "mlflow", "trackio")


@dataclass(kw_only=True)
class Job:
    """Where the run lives, what it trains against, and how it computes."""
    out: str = option("dflash-run", help="Run directory: checkpoints/, train_log.jsonl, drafter/ (default ./dflash-run).")
    # None: the target the cache manifest records.
    target: str | None = option(None, help="Target directory for the frozen embedding and lm_head (default: the one the cache records).")
    # None: the preset whose [target] matches the cache, if any.
    preset: str | None = option(None, help="Recipe from presets/ ('tiny', 'qwen3.6-27b'); default: the one matching the cache's target.")
    seed: int = option(0, help="Seed for init, data order, anchors and noise.")
    dtype: str = option("auto", help="'auto' (bf16 autocast where supported), 'float32' or 'bfloat16'.")
    attention: str = option("auto", help="Training attention: 'auto' (flex on CUDA, else split), 'flex' (BlockMask; CUDA) or 'split' (context + in-block parts).")

    def __post_init__(self):
        refuse_failed([
            (self.dtype in ("auto", "float32", "bfloat16"), f"dtype must be auto/float32/bfloat16, got {self.dtype!r}"),
            (self.attention in ("auto", "flex", "split"), f"attention must be auto/flex/split, got {self.attention!r}"),
        ])


@dataclass(kw_only=True)
class Data:
    """The cache and how samples are read from it."""
    cache: str = option("dflash-cache", help="Cache written by `pipeline extract`: a directory, file://PATH or s3://BUCKET/PREFIX (default ./dflash-cache).")
    # A remote (s3://) cache's files copied to local disk on first read, least recently used
    # deleted past the size (bytes, or with a K/M/G/T suffix): later epochs read the copies.
    cache_local: str | None = option(None, help="For an s3:// cache: copy each file to this local directory on first read, so later epochs read the copies.")
    cache_local_size: str = option("100G", help="Most bytes kept under --cache-local, e.g. 500G (least recently used copies deleted; default 100G).")
    allow_mixed_provenance: bool = option(False, help="Train on shards computed by different linear-attention kernels (warns).")
    allow_incomplete_cache: bool = option(False, help="Train on a cache whose shards are not all committed (warns; recorded in run.json).")
    max_length: int = option(3072, help="Longest sample trained on, in tokens: a longer one's tail is not read (default: the preset's; 3072).")
    num_anchors: int = option(512, help="Anchors per sequence, resampled every epoch.")
    mix_shards: int = option(16, help="Shards whose samples are shuffled together, so each global batch mixes them (default 16).")
    # None: ACCELERATOR_READ_AHEAD on an accelerator, 0 on the CPU (pipeline/training/stream.py read_ahead).
    prefetch: int | None = option(None, help="Decoded samples read ahead a rank on a thread; 0: read in the training thread (default: 16 on an accelerator, 0 on the CPU).")
    loader_workers: int = option(0, help="Loader processes a rank; 0 (default): read in the training process.")

    def __post_init__(self):
        refuse_failed([
            (self.max_length >= 2, f"max_length must be >= 2, got {self.max_length}"),
            (self.num_anchors >= 1, f"num_anchors must be >= 1, got {self.num_anchors}"),
            (self.mix_shards >= 1, f"mix_shards must be >= 1, got {self.mix_shards}"),
            (self.prefetch is None or self.prefetch >= 0, f"prefetch must be >= 0, got {self.prefetch}"),
            (self.loader_workers >= 0, f"loader_workers must be >= 0, got {self.loader_workers}"),
            (parse_size(self.cache_local_size) is not None,
             f"cache_local_size must be a byte count such as 500G, got {self.cache_local_size!r}"),
        ])


@dataclass(kw_only=True)
class DrafterShape:
    """The drafter as the user asks for it. None means "the target's" (DESIGN 2: a target's
    reference drafter may differ from it, as Qwen3.6-27B's does); pipeline/training/drafter_shape.py
    resolves it against the target into the DrafterConfig the model is built from, which checks
    the shape (block size, layer kinds) once."""
    num_hidden_layers: int = option(5, help="Drafter decoder layers.")
    block_size: int = option(16, help="Draft block size B.")
    # None: the cache's; set: must equal the cache's.
    target_layer_ids: list[int] | None = option(None, parse=int_list, help="The target layers the drafter reads, comma-separated; must equal the cache's (default: the cache's).")
    # A token id, or a token string looked up in the target's tokenizer.
    mask_token: str | int = option("<|MASK|>", parse=token_or_id, help="The drafter's mask token: an integer id or a token of the target's tokenizer, reserved and never in the data (default: the preset's; '<|MASK|>' for the embedded target, 248070 for Qwen3.6).")
    num_attention_heads: int | None = option(None, help="Drafter query heads (default: the preset's, else the target's).")
    num_key_value_heads: int | None = option(None, help="Drafter key/value heads (default: the preset's, else the target's).")
    head_dim: int | None = option(None, help="Drafter head width (default: the preset's, else the target's).")
    intermediate_size: int | None = option(None, help="Drafter MLP width (default: the preset's, else the target's).")
    rope_theta: float | None = option(None, help="Drafter RoPE base (default: the preset's, else the target's).")
    max_position_embeddings: int | None = option(None, help="Drafter context length (default: the preset's, else the target's).")
    # As transformers' Qwen3 config names them: None = every layer "full_attention";
    # "sliding_attention" layers see `sliding_window` positions (pipeline/drafter/model.py).
    layer_types: list[str] | None = option(None, parse=text_list, help="Each drafter layer's kind, comma-separated: 'full_attention' or 'sliding_attention' (default: the preset's, else all full).")
    sliding_window: int | None = option(None, help="Positions a sliding_attention layer sees (default: the preset's).")
    # A draft vocabulary (DESIGN 3.4; pipeline/training/draft_vocab.py): off by default until measured.
    draft_vocab: int | None = option(None, help="Draft from the K tokens the target predicts most often in the cache (its head: those K rows of the lm_head; reserved and byte tokens always kept); default: the whole vocabulary. README: Draft vocabulary.")
    projected_fc: str = option("energy", help="On a projected cache (extract --project-taps): how fc' reads the stored components: 'energy' (each at its pilot RMS, fc' initialised as a whole-tap fc restricted to the basis; default) or 'unit' (as stored, unit RMS each: the first form, which lost tau).")

    def __post_init__(self):
        refuse_failed([
            (self.num_hidden_layers >= 1, f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}"),
            (self.draft_vocab is None or self.draft_vocab >= 8, f"draft_vocab must be >= 8 (or unset), got {self.draft_vocab}"),
            (self.projected_fc in ("energy", "unit"), f"projected_fc must be energy/unit, got {self.projected_fc!r}"),
        ])


@dataclass(kw_only=True)
class Objective:
    """What the drafter is trained to predict and how slots are weighted (DESIGN 3.4, 3.6)."""
    # A weighted sum of terms (pipeline/training/objectives.py); each term is logged as loss_<term>.
    loss: str = option("ce", help="The objective, a weighted sum of terms: 'ce' (hard, the target's argmax; default), 'kl', 'tv', 'nla', 'lk' (over the stored top-k), e.g. 'ce + 0.5*tv'. README: Objectives.")
    position_weight: str = option("decay", help="Slot weights: 'decay' (exp(-(k-1)/gamma); default) or 'dpace' (each slot's expected-acceptance gain, from the drafter's own confidence).")
    # D-PACE smoothing: s_k = (1 - a) q_k + a, 0 < a <= 1.
    dpace_alpha: float = option(0.5, help="D-PACE smoothing a in (0, 1] (default 0.5).")
    gamma: float | None = option(None, help="The decay's gamma (default: 7 for block 16, 5 for 10, 4 for 8; the nearest of those otherwise).")
    noise_std: float = option(0.0, help="Gaussian noise on the input context features (0: off).")
    noise_schedule: str = option("constant", help="'constant' (default) or 'linear' (the noise falls to 0 at the last step).")

    def __post_init__(self):
        refuse_failed([
            (_loss_error(self.loss) is None, _loss_error(self.loss)),
            (self.position_weight in ("decay", "dpace"), f"position_weight must be 'decay' or 'dpace', got {self.position_weight!r}"),
            (0 < self.dpace_alpha <= 1, f"dpace_alpha must be in (0, 1], got {self.dpace_alpha}"),
            (self.gamma is None or self.gamma > 0, f"gamma must be > 0, got {self.gamma}"),
            (self.noise_std >= 0, f"noise_std must be >= 0, got {self.noise_std}"),
            (self.noise_schedule in ("constant", "linear"), f"noise_schedule must be 'constant' or 'linear', got {self.noise_schedule!r}"),
        ])


@dataclass(kw_only=True)
class Optimizer:
    """AdamW with warmup and a cosine decay."""
    lr: float = option(6e-4, help="Peak learning rate (AdamW, warmup + cosine).")
    min_lr_ratio: float = option(0.0, help="The cosine's floor as a fraction of --lr (default 0).")
    warmup_ratio: float = option(0.04, help="Warmup steps as a fraction of all steps (default 0.04).")
    warmup_steps: int | None = option(None, help="Warmup steps; overrides --warmup-ratio.")
    grad_clip: float = option(1.0, help="Gradient norm clip (default 1.0).")
    weight_decay: float = option(0.0, help="AdamW weight decay (default 0).")
    betas: list[float] = option(factory=lambda: [0.9, 0.95], parse=float_list, help="AdamW betas, comma-separated (default 0.9,0.95).")

    def __post_init__(self):
        refuse_failed([
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"),
            (0 <= self.warmup_ratio < 1, f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}"),
            (self.warmup_steps is None or self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}"),
            (self.grad_clip > 0, f"grad_clip must be > 0, got {self.grad_clip}"),
            (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"betas must be two numbers in [0, 1), got {self.betas}"),
        ])


@dataclass(kw_only=True)
class Schedule:
    """How long, in what steps, and how often the run logs and checkpoints."""
    num_epochs: int = option(6, help="Epochs over the cache.")
    max_steps: int | None = option(None, help="Stop after this many optimizer steps (default: num_epochs of the cache).")
    batch_sequences: int = option(16, help="Sequences per optimizer step, all ranks together.")
    # The memory bound, not a fixed size: how a share is cut under it depends on the device
    # (pipeline/training/micro_batches.py).
    micro_batch_sequences: int = option(1, help="Most sequences per forward on one rank: the memory bound (gradients accumulate over the forwards). On the CPU a step's share is cut by size into possibly more forwards where that saves padding; on a GPU into the fewest this bound allows.")
    log_every: int = option(10, help="Steps between train_log.jsonl lines.")
    checkpoint_every: int = option(500, help="Steps between training checkpoints.")
    keep_checkpoints: int = option(2, help="Checkpoints kept; older ones are deleted (default 2).")

    def __post_init__(self):
        refuse_failed([
            (self.num_epochs >= 1, f"num_epochs must be >= 1, got {self.num_epochs}"),
            (self.max_steps is None or self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}"),
            (self.batch_sequences >= 1, f"batch_sequences must be >= 1, got {self.batch_sequences}"),
            (self.micro_batch_sequences >= 1, f"micro_batch_sequences must be >= 1, got {self.micro_batch_sequences}"),
            (self.log_every >= 1, f"log_every must be >= 1, got {self.log_every}"),
            (self.checkpoint_every >= 1, f"checkpoint_every must be >= 1, got {self.checkpoint_every}"),
            (self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}"),
        ])


@dataclass(kw_only=True)
class Tracking:
    """Watching the run: experiment trackers (rank 0 reports) and the live verdicts
    (pipeline/report/live.py)."""
    report_to: list[str] = option(factory=list, parse=text_list, help=f"Experiment trackers, comma-separated: {', '.join(TRACKER_NAMES)} (each an optional extra; default none). README: Watching a run.")
    verdict_every: int = option(5, help="Log lines between live verdict checks (loss flat, plateau, spikes, known bug signatures; default 5).")

    def __post_init__(self):
        self.report_to = tracker_names(self.report_to)
        refuse_failed([(self.verdict_every >= 1, f"verdict_every must be >= 1, got {self.verdict_every}")])


@dataclass(kw_only=True)
class TrainConfig:
    """Drafter training, by component. A run records it as dataclasses.asdict (a table a
    component); tables.flat_record reads that, or an older run's flat record, setting by setting."""
    job: Job = field(default_factory=Job)
    data: Data = field(default_factory=Data)
    drafter: DrafterShape = field(default_factory=DrafterShape)
    objective: Objective = field(default_factory=Objective)
    optimizer: Optimizer = field(default_factory=Optimizer)
    schedule: Schedule = field(default_factory=Schedule)
    tracking: Tracking = field(default_factory=Tracking)


def tracker_names(value: str | list[str] | None) -> list[str]:
    """'tensorboard,mlflow' -> ['tensorboard', 'mlflow']; '' / 'none' / None -> []; unknown names refused."""
    if value is None:
        return []
    items = value if isinstance(value, list) else value.split(",")
    names = [str(x).strip().lower() for x in items if str(x).strip()]
    if names in (["none"], []):
        return []
    unknown = [n for n in names if n not in TRACKER_NAMES]
    if unknown:
        raise PipelineError(f"report_to: unknown tracker {', '.join(map(repr, unknown))}; choose from {', '.join(TRACKER_NAMES)}")
    return list(dict.fromkeys(names))


# The loss expression's syntax; the terms' mathematics is pipeline/training/objectives.py.
LOSS_TERMS = ("ce", "kl", "tv", "nla", "lk")


def parse_loss(expression: str) -> dict[str, float]:
    """{term: coefficient} of `ce`, `lk`, `ce + 0.5*tv`, `0.3*kl+0.7*tv` ...; raises ValueError."""
    terms: dict[str, float] = {}
    for part in str(expression).replace(" ", "").split("+"):
        match = re.fullmatch(r"(?:([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\*)?([a-z]+)", part)
        if not match or match.group(2) not in LOSS_TERMS:
            raise ValueError(f"loss {expression!r}: each term is NAME or COEF*NAME with NAME one of "
                             f"{', '.join(LOSS_TERMS)} (e.g. 'ce', 'lk', 'ce + 0.5*tv')")
        name, coefficient = match.group(2), float(match.group(1) or 1.0)
        if name in terms:
            raise ValueError(f"loss {expression!r}: {name} appears twice")
        if coefficient <= 0:
            raise ValueError(f"loss {expression!r}: coefficients must be > 0")
        terms[name] = coefficient
    return terms


def _loss_error(expression: str) -> str | None:
    try:
        parse_loss(expression)
    except ValueError as e:
        return str(e)
    return None
