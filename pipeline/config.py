"""Keyword-only config dataclasses, loaded from TOML with per-option overrides.

Precedence: explicit CLI option > the TOML file (`--config`, else ./extract.toml if present) >
the defaults below, which point at the embedded tiny target and its dataset. Unknown keys are
errors that name the file and the key.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.tracking import TRACKERS, parse_report_to

EMBEDDED = "embedded"


def option(default=dataclasses.MISSING, *, help: str, factory=None, parse=None, flag: str | None = None,
           argument: bool = False, metavar: str | None = None, negatable: bool = False):
    """A config field that is also the command-line option `--NAME` (hyphens for underscores),
    with this help text: the command's option is derived from the field (pipeline/ui/options.py),
    so a new option is one field. The option's type is the field's (str, int, float, Path, bool: a
    `--NAME` flag when the default is False, else `--NAME/--no-NAME`; `negatable` gives a False
    default its `--no-NAME` too; a list: repeatable); `parse(text, flag)` turns the option's text
    into the value where the field is anything else. `flag` names the option where the field's
    name cannot (`--json` for `json_out`); `argument` makes it positional; `metavar` names its
    value in --help. A field without a default is a required option."""
    metadata = {"help": help, "parse": parse, "flag": flag, "argument": argument, "metavar": metavar,
                "negatable": negatable}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def int_list(text: str, flag: str) -> list[int]:
    """'1,3,5' -> [1, 3, 5]."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PipelineError(f"{flag}: {text!r} is not a comma-separated list of integers") from None


def text_list(text: str, flag: str) -> list[str]:
    """'tensorboard, mlflow' -> ['tensorboard', 'mlflow']."""
    return [x.strip() for x in text.split(",") if x.strip()]


def token_or_id(text: str, flag: str) -> str | int:
    """'248070' -> 248070 (a token id); anything else stays a token string."""
    return int(text) if text.strip().isdigit() else text


@dataclass(kw_only=True)
class ExtractConfig:
    target: str = option(EMBEDDED, help="Target model directory (default: the embedded tiny target).")
    data: list[str] = option(factory=lambda: ["embedded:train"], help="Conversations: JSONL/Parquet with `messages` or `conversations`, or pre-tokenized rows. Repeatable.")
    cache: str = option("dflash-cache", help="Cache to create or resume: a directory, file://PATH or s3://BUCKET/PREFIX (default ./dflash-cache).")
    num_shards: int = option(64, help="Fixed shard count of the cache (default 64).")
    # None: the preset's taps (tiny) or default_taps(L, 5).
    layers: list[int] | None = option(None, parse=int_list, help="Comma-separated 0-based decoder-layer taps (default: the target preset's).")
    top_k: int = option(32, help="Target top-k ids/logits stored per token (default 32).")
    hidden_format: str = option("bf16", help="'bf16' (lossless bit pattern) or 'fp8' (e4m3 + per-token scale).")
    max_length: int = option(4096, help="Longest sample in tokens; longer ones follow --overlong.")
    overlong: str = option("truncate", help="'truncate' (default), 'skip' or 'error' on over-long samples ('error' stops at the first one, when its shard is reached).")
    on_error: str = option("fail", help="'fail' (default) or 'skip' malformed rows (counted in the manifest).")
    end_of_turn: str = "<|im_end|>"
    chat_template_kwargs: dict = field(default_factory=dict)   # e.g. {enable_thinking = false}
    # Reasoning in the data while thinking is off (DESIGN 3.5): "error" refuses the row, "drop"
    # removes the reasoning before rendering, "keep" renders and supervises it as the data has it.
    reasoning: str = option("error", help="Reasoning in the data while thinking is off: 'error' (default: refuse the row), 'drop' it, or 'keep' and supervise it.")
    # DESIGN 3.7.
    generated_by: str | None = option(None, help="Who wrote the responses (e.g. the target's name), recorded in the manifest for rows that do not say.")
    compute_dtype: str = "auto"                   # "auto" (bf16 on GPU, fp32 on CPU) | "float32" | "bfloat16"
    batch_tokens: int = option(8192, help="Forward batch budget in tokens, padding included.")
    zstd_level: int = 3
    # Overrides of the cache's file layout (pipeline/cache/schema.py Chunking: hidden_chunk_bytes,
    # hidden_chunks_per_file, small_chunk_tokens, small_chunks_per_file); the defaults fit the
    # flagship width. Recorded in the manifest.
    chunking: dict = field(default_factory=dict)
    tp: int = option(1, help="Tensor-parallel size under torchrun; world_size / tp data-parallel groups.")
    # Batches queued for the background writer. None = auto: 4 when the target runs on a GPU;
    # 0 (write inline) on CPU, where a concurrent writer thread slows the multi-threaded forward
    # by more than the writing costs (BENCHMARKS.md: 0.75 vs 0.95 of bare forward throughput).
    writer_queue: int | None = None
    # In a cache directory, a second process skips a shard another one is writing (flock on
    # .shard-NNNNN.lock). Correctness never depends on it (DESIGN 11: commit records); turn it
    # off where flock hangs or is not supported. An object store has no locks.
    # Store the taps projected onto a basis fitted on a pilot (pipeline/projection): R values a
    # token instead of n_taps x hidden_size; the drafter trains fc on them and the export folds the
    # basis back into an ordinary fc. None: the taps whole.
    project_taps: int | None = option(None, help="Store the taps projected to R values a token (a basis fitted on a pilot of the first shards; the export folds it into fc). Pick R with `pipeline cache-info --energy` on a first shard (default: the taps whole).")
    pilot_tokens: int = option(131_072, help="With --project-taps: tokens of the first shards the basis is fitted on, run through the target once more (default 131,072).")
    shard_locks: bool = option(True, help="In a cache directory, skip shards another process is writing (flock; default on). Off where flock does not work: commits stay safe without it.")

    def __post_init__(self):
        checks = [
            (self.num_shards >= 1, f"num_shards must be >= 1, got {self.num_shards}"),
            (1 <= self.top_k <= 1024, f"top_k must be in 1..1024, got {self.top_k}"),
            (self.hidden_format in ("bf16", "fp8"), f"hidden_format must be 'bf16' or 'fp8', got {self.hidden_format!r}"),
            (self.max_length >= 2, f"max_length must be >= 2, got {self.max_length}"),
            (self.overlong in ("truncate", "skip", "error"), f"overlong must be 'truncate', 'skip' or 'error', got {self.overlong!r}"),
            (self.on_error in ("fail", "skip"), f"on_error must be 'fail' or 'skip', got {self.on_error!r}"),
            (self.reasoning in ("error", "drop", "keep"), f"reasoning must be 'error', 'drop' or 'keep', got {self.reasoning!r}"),
            (isinstance(self.chat_template_kwargs, dict), "chat_template_kwargs must be a table"),
            (self.compute_dtype in ("auto", "float32", "bfloat16"), f"compute_dtype must be auto/float32/bfloat16, got {self.compute_dtype!r}"),
            (self.batch_tokens >= 1, f"batch_tokens must be >= 1, got {self.batch_tokens}"),
            (1 <= self.zstd_level <= 22, f"zstd_level must be in 1..22, got {self.zstd_level}"),
            (self.tp >= 1, f"tp must be >= 1, got {self.tp}"),
            (isinstance(self.chunking, dict), "chunking must be a table"),
            (self.writer_queue is None or self.writer_queue >= 0, f"writer_queue must be >= 0, got {self.writer_queue}"),
            (isinstance(self.data, list) and self.data, "data must be a non-empty list of files"),
            (self.project_taps is None or self.project_taps >= 1, f"project_taps must be >= 1, got {self.project_taps}"),
            (self.pilot_tokens >= 1, f"pilot_tokens must be >= 1, got {self.pilot_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise PipelineError(message)


def read_config_file(cls, path: Path | None, *, section: str) -> dict:
    """The `[section]` table (or top-level keys) of a TOML file, unknown keys refused, relative
    paths made relative to the file."""
    if path is None:
        return {}
    if not path.is_file():
        raise PipelineError(f"{path}: config file not found")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PipelineError(f"{path}: invalid TOML ({e})") from None
    values = raw.get(section, raw)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise PipelineError(f"{path}: unknown key(s) {', '.join(unknown)} in [{section}]")
    # Relative paths in a config file are relative to the file, not to where you stand.
    for key in ("target", "cache", "out"):
        if isinstance(values.get(key), str) and values[key] != EMBEDDED and not values[key].startswith("embedded:"):
            values[key] = str((path.parent / values[key]).resolve()) if not Path(values[key]).is_absolute() else values[key]
    if isinstance(values.get("data"), str):
        values["data"] = [values["data"]]
    if isinstance(values.get("data"), list):
        values["data"] = [d if d.startswith("embedded:") or Path(d).is_absolute() else str((path.parent / d).resolve())
                          for d in values["data"]]
    return values


def load_config(cls, path: Path | None, overrides: dict, *, section: str, base: dict | None = None):
    """cls from `base` (a preset), then TOML `[section]` at `path`, then non-None `overrides`."""
    values = {**(base or {}), **read_config_file(cls, path, section=section)}
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**values)
    except TypeError as e:
        raise PipelineError(f"{path or 'options'}: {e}") from None


def parse_size(text) -> int | None:
    """'500G' -> bytes (K, M, G, T: powers of 1024); None when it is not a positive size."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(text), re.IGNORECASE)
    if not m:
        return None
    value = int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))
    return value if value > 0 else None


@dataclass(kw_only=True)
class TrainConfig:
    """Drafter training. Defaults are DESIGN's (block 16, 512 anchors, gamma by block size); a
    preset (`presets/NAME.toml`, [drafter] table) supplies a whole recipe."""
    cache: str = option("dflash-cache", help="Cache written by `pipeline extract`: a directory, file://PATH or s3://BUCKET/PREFIX (default ./dflash-cache).")
    out: str = option("dflash-run", help="Run directory: checkpoints/, train_log.jsonl, drafter/ (default ./dflash-run).")
    # None: the target the cache manifest records.
    target: str | None = option(None, help="Target directory for the frozen embedding and lm_head (default: the one the cache records).")
    # None: the preset whose [target] matches the cache, if any.
    preset: str | None = option(None, help="Recipe from presets/ ('tiny', 'qwen3.6-27b'); default: the one matching the cache's target.")
    # Drafter architecture.
    num_hidden_layers: int = option(5, help="Drafter decoder layers.")
    block_size: int = option(16, help="Draft block size B.")
    target_layer_ids: list[int] | None = None   # None: the cache's; set: must equal the cache's
    # A token id, or a token string looked up in the target's tokenizer.
    mask_token: str | int = option("<|MASK|>", parse=token_or_id, help="The drafter's mask token: an integer id or a token of the target's tokenizer, reserved and never in the data (default: the preset's; '<|MASK|>' for the embedded target, 248070 for Qwen3.6).")
    # The drafter's own attention and MLP geometry; None: the target's (DESIGN 2: the reference
    # drafter of a target may differ from it, as Qwen3.6-27B's does).
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rope_theta: float | None = None
    max_position_embeddings: int | None = None
    # Layer kinds (DESIGN 2), as transformers' Qwen3 config names them: None = every layer
    # "full_attention"; "sliding_attention" layers see a window of `sliding_window` positions,
    # causally inside the block (the serving engines' rule: pipeline/drafter/model.py).
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    attention: str = option("auto", help="Training attention: 'auto' (flex on CUDA, else split), 'flex' (BlockMask; CUDA) or 'split' (context + in-block parts).")
    # Data.
    num_anchors: int = option(512, help="Anchors per sequence, resampled every epoch.")
    max_length: int = 3072
    # Loss (DESIGN 3.4, 3.6).
    # A weighted sum of terms (pipeline/training/objectives.py): "ce" (hard, default), "kl", "tv",
    # "nla", "lk" (over the stored top-k), e.g. "ce + 0.5*tv"; each term is logged as loss_<term>.
    loss: str = option("ce", help="The objective, a weighted sum of terms: 'ce' (hard, the target's argmax; default), 'kl', 'tv', 'nla', 'lk' (over the stored top-k), e.g. 'ce + 0.5*tv'. README: Objectives.")
    position_weight: str = option("decay", help="Slot weights: 'decay' (exp(-(k-1)/gamma); default) or 'dpace' (each slot's expected-acceptance gain, from the drafter's own confidence).")
    # D-PACE smoothing: s_k = (1 - a) q_k + a, 0 < a <= 1.
    dpace_alpha: float = option(0.5, help="D-PACE smoothing a in (0, 1] (default 0.5).")
    gamma: float | None = None               # None: 7 for B=16, 5 for B=10, 4 for B=8
    # A draft vocabulary (DESIGN 3.4; pipeline/training/draft_vocab.py): off by default until measured.
    draft_vocab: int | None = option(None, help="Draft from the K tokens the target predicts most often in the cache (its head: those K rows of the lm_head; reserved and byte tokens always kept); default: the whole vocabulary. README: Draft vocabulary.")
    projected_fc: str = option("energy", help="On a projected cache (extract --project-taps): how fc' reads the stored components: 'energy' (each at its pilot RMS, fc' initialised as a whole-tap fc restricted to the basis; default) or 'unit' (as stored, unit RMS each: the first form, which lost tau).")
    noise_std: float = option(0.0, help="Gaussian noise on the input context features (0: off).")
    noise_schedule: str = "constant"         # "constant" | "linear" (to 0 at the last step)
    # Optimisation.
    lr: float = option(6e-4, help="Peak learning rate (AdamW, warmup + cosine).")
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    warmup_steps: int | None = None          # overrides warmup_ratio
    num_epochs: int = option(6, help="Epochs over the cache.")
    max_steps: int | None = option(None, help="Stop after this many optimizer steps (default: num_epochs of the cache).")
    batch_sequences: int = option(16, help="Sequences per optimizer step, all ranks together.")
    # The memory bound, not a fixed size: how a share is cut under it depends on the device
    # (pipeline/training/micro_batches.py).
    micro_batch_sequences: int = option(1, help="Most sequences per forward on one rank: the memory bound (gradients accumulate over the forwards). On the CPU a step's share is cut by size into possibly more forwards where that saves padding; on a GPU into the fewest this bound allows.")
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    dtype: str = option("auto", help="'auto' (bf16 autocast where supported), 'float32' or 'bfloat16'.")
    seed: int = option(0, help="Seed for init, data order, anchors and noise.")
    # Bookkeeping.
    log_every: int = option(10, help="Steps between train_log.jsonl lines.")
    checkpoint_every: int = option(500, help="Steps between training checkpoints.")
    keep_checkpoints: int = 2
    mix_shards: int = 16                     # shards whose samples are shuffled together (each global batch mixes them)
    prefetch: int | None = None              # decoded samples read ahead per rank on a thread; 0: read in the training thread; None: 16 on an accelerator, 0 on the CPU (pipeline/training/stream.py `read_ahead`)
    loader_workers: int = 0                  # loader processes per rank; 0: read in the training process (on a thread or not: `prefetch`)
    allow_mixed_provenance: bool = option(False, help="Train on shards computed by different linear-attention kernels (warns).")
    allow_incomplete_cache: bool = option(False, help="Train on a cache whose shards are not all committed (warns; recorded in run.json).")
    # A remote (s3://) cache's files copied to local disk on first read, least recently used
    # deleted past the size (bytes, or with a K/M/G/T suffix): later epochs read the copies.
    cache_local: str | None = option(None, help="For an s3:// cache: copy each file to this local directory on first read, so later epochs read the copies.")
    cache_local_size: str = option("100G", help="Most bytes kept under --cache-local, e.g. 500G (least recently used copies deleted; default 100G).")
    # Watching the run: experiment trackers (any of pipeline.tracking.TRACKERS; rank 0
    # reports) and the live verdicts (pipeline/report/live.py), checked every `verdict_every` log lines.
    report_to: list[str] = option(factory=list, parse=text_list, help=f"Experiment trackers, comma-separated: {', '.join(TRACKERS)} (each an optional extra; default none). README: Watching a run.")
    verdict_every: int = option(5, help="Log lines between live verdict checks (loss flat, plateau, spikes, known bug signatures; default 5).")

    def __post_init__(self):
        self.report_to = parse_report_to(self.report_to)
        checks = [
            (self.num_hidden_layers >= 1, f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}"),
            (self.block_size >= 2, f"block_size must be >= 2, got {self.block_size}"),
            (self.num_anchors >= 1, f"num_anchors must be >= 1, got {self.num_anchors}"),
            (self.max_length >= 2, f"max_length must be >= 2, got {self.max_length}"),
            (_loss_error(self.loss) is None, _loss_error(self.loss)),
            (self.position_weight in ("decay", "dpace"), f"position_weight must be 'decay' or 'dpace', got {self.position_weight!r}"),
            (0 < self.dpace_alpha <= 1, f"dpace_alpha must be in (0, 1], got {self.dpace_alpha}"),
            (self.gamma is None or self.gamma > 0, f"gamma must be > 0, got {self.gamma}"),
            (self.draft_vocab is None or self.draft_vocab >= 8, f"draft_vocab must be >= 8 (or unset), got {self.draft_vocab}"),
            (self.noise_std >= 0, f"noise_std must be >= 0, got {self.noise_std}"),
            (self.noise_schedule in ("constant", "linear"), f"noise_schedule must be 'constant' or 'linear', got {self.noise_schedule!r}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"),
            (0 <= self.warmup_ratio < 1, f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}"),
            (self.warmup_steps is None or self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}"),
            (self.num_epochs >= 1, f"num_epochs must be >= 1, got {self.num_epochs}"),
            (self.max_steps is None or self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}"),
            (self.batch_sequences >= 1, f"batch_sequences must be >= 1, got {self.batch_sequences}"),
            (self.micro_batch_sequences >= 1, f"micro_batch_sequences must be >= 1, got {self.micro_batch_sequences}"),
            (self.mix_shards >= 1, f"mix_shards must be >= 1, got {self.mix_shards}"),
            (self.grad_clip > 0, f"grad_clip must be > 0, got {self.grad_clip}"),
            (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"betas must be two numbers in [0, 1), got {self.betas}"),
            (self.dtype in ("auto", "float32", "bfloat16"), f"dtype must be auto/float32/bfloat16, got {self.dtype!r}"),
            (self.attention in ("auto", "flex", "split"), f"attention must be auto/flex/split, got {self.attention!r}"),
            (self.projected_fc in ("energy", "unit"), f"projected_fc must be energy/unit, got {self.projected_fc!r}"),
            (self.log_every >= 1, f"log_every must be >= 1, got {self.log_every}"),
            (self.checkpoint_every >= 1, f"checkpoint_every must be >= 1, got {self.checkpoint_every}"),
            (self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}"),
            (self.prefetch is None or self.prefetch >= 0, f"prefetch must be >= 0, got {self.prefetch}"),
            (self.loader_workers >= 0, f"loader_workers must be >= 0, got {self.loader_workers}"),
            (self.verdict_every >= 1, f"verdict_every must be >= 1, got {self.verdict_every}"),
            (parse_size(self.cache_local_size) is not None,
             f"cache_local_size must be a byte count such as 500G, got {self.cache_local_size!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise PipelineError(message)


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
