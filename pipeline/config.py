"""Keyword-only config dataclasses, loaded from TOML with per-option overrides.

Precedence: explicit CLI option > the TOML file (`--config`, else ./extract.toml if present) >
the defaults below, which point at the embedded tiny target and its dataset. Unknown keys are
errors that name the file and the key.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import PipelineError

EMBEDDED = "embedded"


@dataclass(kw_only=True)
class ExtractConfig:
    target: str = EMBEDDED                        # model directory, or "embedded"
    data: list[str] = field(default_factory=lambda: ["embedded:train"])
    cache: str = "dflash-cache"
    num_shards: int = 64
    layers: list[int] | None = None               # None: the preset's taps (tiny) or default_taps(L, 5)
    top_k: int = 32
    hidden_format: str = "bf16"                   # "bf16" | "fp8"
    max_length: int = 4096
    overlong: str = "truncate"                    # "truncate" | "skip"
    on_error: str = "fail"                        # "fail" | "skip"
    end_of_turn: str = "<|im_end|>"
    chat_template_kwargs: dict = field(default_factory=dict)   # e.g. {enable_thinking = false}
    compute_dtype: str = "auto"                   # "auto" (bf16 on GPU, fp32 on CPU) | "float32" | "bfloat16"
    batch_tokens: int = 8192                      # forward batch budget, padding included
    zstd_level: int = 3
    tp: int = 1
    # Batches queued for the background writer. None = auto: 4 when the target runs on a GPU;
    # 0 (write inline) on CPU, where a concurrent writer thread slows the multi-threaded forward
    # by more than the writing costs (BENCHMARKS.md: 0.75 vs 0.95 of bare forward throughput).
    writer_queue: int | None = None

    def __post_init__(self):
        checks = [
            (self.num_shards >= 1, f"num_shards must be >= 1, got {self.num_shards}"),
            (1 <= self.top_k <= 1024, f"top_k must be in 1..1024, got {self.top_k}"),
            (self.hidden_format in ("bf16", "fp8"), f"hidden_format must be 'bf16' or 'fp8', got {self.hidden_format!r}"),
            (self.max_length >= 2, f"max_length must be >= 2, got {self.max_length}"),
            (self.overlong in ("truncate", "skip"), f"overlong must be 'truncate' or 'skip', got {self.overlong!r}"),
            (self.on_error in ("fail", "skip"), f"on_error must be 'fail' or 'skip', got {self.on_error!r}"),
            (self.compute_dtype in ("auto", "float32", "bfloat16"), f"compute_dtype must be auto/float32/bfloat16, got {self.compute_dtype!r}"),
            (self.batch_tokens >= 1, f"batch_tokens must be >= 1, got {self.batch_tokens}"),
            (1 <= self.zstd_level <= 22, f"zstd_level must be in 1..22, got {self.zstd_level}"),
            (self.tp >= 1, f"tp must be >= 1, got {self.tp}"),
            (self.writer_queue is None or self.writer_queue >= 0, f"writer_queue must be >= 0, got {self.writer_queue}"),
            (isinstance(self.data, list) and self.data, "data must be a non-empty list of files"),
        ]
        for ok, message in checks:
            if not ok:
                raise PipelineError(message)


def load_config(cls, path: Path | None, overrides: dict, *, section: str):
    """cls from TOML `[section]` (or top-level keys) at `path`, then non-None `overrides`."""
    values: dict = {}
    if path is not None:
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
        for key in ("target", "cache"):
            if isinstance(values.get(key), str) and values[key] != EMBEDDED and not values[key].startswith("embedded:"):
                values[key] = str((path.parent / values[key]).resolve()) if not Path(values[key]).is_absolute() else values[key]
        if isinstance(values.get("data"), str):
            values["data"] = [values["data"]]
        if isinstance(values.get("data"), list):
            values["data"] = [d if d.startswith("embedded:") or Path(d).is_absolute() else str((path.parent / d).resolve())
                              for d in values["data"]]
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**values)
    except TypeError as e:
        raise PipelineError(f"{path or 'options'}: {e}") from None
