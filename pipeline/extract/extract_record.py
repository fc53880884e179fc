"""What extract records about a cache before writing it: its identity (everything that decides
its content; a later invocation must match it exactly), the storage chunking, and the array
dimensions the schema's symbolic shapes resolve to."""

from __future__ import annotations

from pathlib import Path

from pipeline.cache.identity import Identity, ProjectionRecord, parse_identity
from pipeline.cache.schema import Chunking
from pipeline.config import ExtractConfig
from pipeline.data.loss_mask import GenerationPrompt
from pipeline.errors import PipelineError
from pipeline.records.typed import dump_record
from pipeline.provenance import tokenizer_digest, weight_digests
from pipeline.target_model import chat_template_sha256
from pipeline.target_model.taps import TAP_CONVENTION


def identity_record(cfg: ExtractConfig, *, facts, tokenizer, prompt: GenerationPrompt, target_dir: Path, taps: list[int], dataset: dict,
                    compute_dtype: str, projection: ProjectionRecord | None = None) -> Identity:
    """Everything that decides the cache's content; a later invocation must match it exactly.
    `projection`: the basis of a projected cache (pipeline/extract/pilot_run.py)."""
    return parse_identity({
        "num_shards": cfg.num_shards,
        "target": {"model_type": facts.model_type, "config_sha256": facts.config_sha256,
                   "num_hidden_layers": facts.num_hidden_layers, "weights": weight_digests(target_dir)},
        "tokenizer": {"files_sha256": tokenizer_digest(target_dir),
                      "chat_template_sha256": chat_template_sha256(tokenizer),
                      "chat_template_kwargs": cfg.chat_template_kwargs,
                      "thinking": "on" if prompt.thinking else "off",
                      "generation_prompt": prompt.header + prompt.supplied,
                      "reasoning": cfg.reasoning,
                      "boundary_tokens": "supervised when any of their characters is generated",
                      "end_of_turn": cfg.end_of_turn},
        "data": {"num_rows": dataset["num_rows"], "files": dataset["files"], "generated_by": cfg.generated_by},
        "capture": {"target_layer_ids": taps, "tap_convention": TAP_CONVENTION,
                    "num_hidden_layers": facts.num_hidden_layers, "hidden_size": facts.hidden_size,
                    "vocab_size": facts.vocab_size, "top_k": cfg.top_k, "hidden_format": cfg.hidden_format,
                    "stored_dtype": stored_dtype(cfg.hidden_format, projected=projection is not None),
                    "compute_dtype": compute_dtype, "max_length": cfg.max_length, "overlong": cfg.overlong,
                    "on_error": cfg.on_error, "zstd_level": cfg.zstd_level, "checksum": "crc32c per inner chunk",
                    "storage": chunking(cfg).record(),
                    "projection": None if projection is None else dump_record(projection)},
    })


def stored_dtype(hidden_format: str, *, projected: bool) -> str:
    if hidden_format == "bf16":
        return "bfloat16 bit pattern (uint16)" + (" of the projected taps" if projected else "")
    return ("float8_e4m3fn (uint8) x float32 scale per token" + ("" if projected else " and tap")
            + (", of the projected taps" if projected else ""))


def chunking(cfg: ExtractConfig) -> Chunking:
    try:
        return Chunking.from_options(cfg.chunking)
    except (TypeError, ValueError) as e:
        raise PipelineError(f"chunking: {e}") from None


def cache_dims(cfg: ExtractConfig, facts, taps: list[int]) -> dict[str, int]:
    dims = {"n_taps": len(taps), "hidden_size": facts.hidden_size, "top_k": cfg.top_k}
    if cfg.project_taps is not None:
        dims["projected_rank"] = cfg.project_taps
    return dims
