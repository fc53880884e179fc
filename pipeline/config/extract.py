"""`pipeline extract`'s settings: one flat table, `[extract]`. Each option field is a flag of
`pipeline extract` (pipeline/config/fields.py option); chat_template_kwargs and chunking are
tables, so they stay file-only (docs: Configuration)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.fields import EMBEDDED, int_list, option, refuse_failed


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
    end_of_turn: str = option("<|im_end|>", help="The token that ends a turn in the target's chat template (default <|im_end|>).")
    chat_template_kwargs: dict = field(default_factory=dict)   # e.g. {enable_thinking = false}
    # Reasoning in the data while thinking is off (DESIGN 3.5): "error" refuses the row, "drop"
    # removes the reasoning before rendering, "keep" renders and supervises it as the data has it.
    reasoning: str = option("error", help="Reasoning in the data while thinking is off: 'error' (default: refuse the row), 'drop' it, or 'keep' and supervise it.")
    # DESIGN 3.7.
    generated_by: str | None = option(None, help="Who wrote the responses (e.g. the target's name), recorded in the manifest for rows that do not say.")
    compute_dtype: str = option("auto", help="The target forward's dtype: 'auto' (bfloat16 on a GPU, float32 on the CPU), 'float32' or 'bfloat16'.")
    batch_tokens: int = option(8192, help="Forward batch budget in tokens, padding included.")
    zstd_level: int = option(3, help="Zstandard level of the stored arrays, 1..22 (default 3).")
    # Overrides of the cache's file layout (pipeline/cache/schema.py Chunking: hidden_chunk_bytes,
    # hidden_chunks_per_file, small_chunk_tokens, small_chunks_per_file); the defaults fit the
    # flagship width. Recorded in the manifest.
    chunking: dict = field(default_factory=dict)
    tp: int = option(1, help="Tensor-parallel size under torchrun; world_size / tp data-parallel groups.")
    # Batches queued for the background writer. None = auto: 4 when the target runs on a GPU;
    # 0 (write inline) on CPU, where a concurrent writer thread slows the multi-threaded forward
    # by more than the writing costs (BENCHMARKS.md: 0.75 vs 0.95 of bare forward throughput).
    writer_queue: int | None = option(None, help="Batches queued for the background writer; 0 writes inline (default: 4 on a GPU, 0 on the CPU).")
    # Store the taps projected onto a basis fitted on a pilot (pipeline/projection): R values a
    # token instead of n_taps x hidden_size; the drafter trains fc on them and the export folds the
    # basis back into an ordinary fc. None: the taps whole. This R is `projected_rank` everywhere
    # else in the code (the cache's dims, the basis, the drafter's config); the field keeps the name
    # of the flag and the [extract] key, which are what a user types.
    project_taps: int | None = option(None, help="Store the taps projected to R values a token (a basis fitted on a pilot of the first shards; the export folds it into fc). Pick R with `pipeline cache-info --energy` on a first shard (default: the taps whole).")
    pilot_tokens: int = option(131_072, help="With --project-taps: tokens of the first shards the basis is fitted on, run through the target once more (default 131,072).")
    # In a cache directory, a second process skips a shard another one is writing (flock on
    # .shard-NNNNN.lock). Correctness never depends on it (DESIGN 11: commit records); turn it
    # off where flock hangs or is not supported. An object store has no locks.
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
        refuse_failed(checks)
