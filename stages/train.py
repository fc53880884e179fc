"""Stage two (issue 5, in progress): train a DFlash drafter from a cache alone, one process.

Per step: `batch_sequences` samples from the stream; per sample, anchors resampled from
(seed, epoch, sample_id); all its anchors in one drafter forward; decayed hard CE against the
stored target argmax, normalised over the whole batch (sum(ce*w)/sum(w)); AdamW with warmup and
cosine decay, gradient clipping. One JSON line per `log_every` steps in train_log.jsonl with
the DESIGN 4 keys. The target's weights are read only for the frozen embedding and lm_head.

Not yet: the `pipeline train` command, checkpoints and exact resume, DDP, noise, soft KL,
bf16 autocast, TOML config (see the issue 5 note).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipeline.cache.reader import CacheReader
from pipeline.drafter.blocks import block_inputs, block_targets, default_gamma, sample_anchors, weighted_ce
from pipeline.drafter.export import export_drafter
from pipeline.drafter.metrics import block_metrics
from pipeline.drafter.model import DFlashDrafter, DrafterConfig
from pipeline.drafter.stream import SampleStream, StreamState
from pipeline.errors import PipelineError
from pipeline.target import read_target_facts


@dataclass(kw_only=True)
class TrainConfig:
    cache: str
    out: str = "runs/drafter"
    target: str | None = None          # default: the manifest's recorded target
    num_hidden_layers: int = 2
    block_size: int = 8
    gamma: float | None = None         # default: DESIGN 3.4's value for the block size
    num_anchors: int = 512
    max_length: int = 4096
    lr: float = 3e-3
    warmup_steps: int = 20
    num_epochs: int = 6
    max_steps: int | None = None
    batch_sequences: int = 8
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    seed: int = 0
    log_every: int = 10
    mask_token: str = "<|MASK|>"


def frozen_target_modules(target_dir: Path) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    """The target's embed_tokens and lm_head, read from its safetensors (nothing else is loaded)."""
    from safetensors import safe_open

    index = target_dir / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    wanted = {"embed": ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
              "lm_head": ("lm_head.weight",)}
    found = {}
    for role, names in wanted.items():
        for name in names:
            path = target_dir / (files.get(name, "") if files else "model.safetensors")
            if not path.is_file():
                continue
            with safe_open(str(path), "pt") as f:
                if name in f.keys():
                    found[role] = f.get_tensor(name).float()
                    break
    if "embed" not in found:
        raise PipelineError(f"{target_dir}: no embed_tokens weight in the target's safetensors")
    weight = found["embed"]
    embed = torch.nn.Embedding.from_pretrained(weight, freeze=True)
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = torch.nn.Parameter(found.get("lm_head", weight), requires_grad=False)  # tied if absent
    return embed, head


def build_drafter(cfg: TrainConfig, reader: CacheReader, target_dir: Path) -> DFlashDrafter:
    from transformers import AutoTokenizer

    facts = read_target_facts(target_dir)
    capture = reader.manifest["config"]["capture"]
    if (facts.hidden_size, facts.vocab_size) != (capture["hidden_size"], capture["vocab_size"]):
        raise PipelineError(f"{target_dir}: hidden size/vocab {facts.hidden_size}/{facts.vocab_size} disagree with "
                            f"the cache's {capture['hidden_size']}/{capture['vocab_size']}")
    text = json.loads((target_dir / "config.json").read_text())
    text = text.get("text_config") or text
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    if cfg.mask_token not in tokenizer.get_vocab():
        raise PipelineError(f"{target_dir}: the tokenizer has no mask token {cfg.mask_token!r}")
    config = DrafterConfig(
        hidden_size=facts.hidden_size, intermediate_size=int(text["intermediate_size"]),
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=facts.num_attention_heads,
        num_key_value_heads=facts.num_key_value_heads, head_dim=int(text.get("head_dim") or facts.hidden_size // facts.num_attention_heads),
        vocab_size=facts.vocab_size, target_layer_ids=list(capture["target_layer_ids"]),
        num_target_layers=facts.num_hidden_layers, mask_token_id=tokenizer.convert_tokens_to_ids(cfg.mask_token),
        block_size=cfg.block_size, rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)))
    embed, head = frozen_target_modules(target_dir)
    torch.manual_seed(cfg.seed)
    return DFlashDrafter(config, embed=embed, lm_head=head)


def sequence_blocks(drafter: DFlashDrafter, sample: dict, cfg: TrainConfig, gamma: float, generator):
    """(logits [A, B, V], labels [A, B], weights [A, B]) for one sequence, or None without anchors."""
    n = min(len(sample["input_ids"]), cfg.max_length)
    ids = torch.from_numpy(sample["input_ids"][:n].astype("int64"))
    mask = torch.from_numpy(sample["loss_mask"][:n].astype("int64"))
    argmax = torch.from_numpy(sample["target_argmax"][:n].astype("int64"))
    anchors = sample_anchors(mask, cfg.num_anchors, generator)
    if len(anchors) == 0:
        return None
    block_ids, pos, allowed = block_inputs(ids, anchors, cfg.block_size, drafter.config.mask_token_id)
    logits = drafter(sample["hidden"][:n].float()[None], block_ids[None], pos[None], allowed[None])
    labels, weights = block_targets(argmax, mask, anchors, cfg.block_size, gamma)
    return logits.view(len(anchors), cfg.block_size, -1), labels, weights


def run_train(cfg: TrainConfig, *, log=print) -> dict:
    reader = CacheReader(cfg.cache)
    recorded = reader.manifest.get("sources", {}).get("target")
    target_dir = Path(cfg.target or recorded or "")
    if not (target_dir / "config.json").is_file():
        raise PipelineError(f"{target_dir}: target directory not found (pass target=...)")
    drafter = build_drafter(cfg, reader, target_dir)
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    samples_per_epoch = sum(reader.manifest["shards"][s]["samples"] for s in reader.shards)
    total_steps = cfg.max_steps or math.ceil(samples_per_epoch / cfg.batch_sequences) * cfg.num_epochs

    def lr_at(step):
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "train_log.jsonl", "w", encoding="utf-8")
    start, step, tokens, last = time.perf_counter(), 0, 0, {}
    drafter.train()
    try:
        for epoch in range(cfg.num_epochs):
            stream = SampleStream(reader, seed=cfg.seed, state=StreamState(epoch=epoch))
            batch = []
            for _, sample in stream.epoch():
                batch.append(sample)
                if len(batch) < cfg.batch_sequences:
                    continue
                last = _step(drafter, opt, batch, cfg, gamma, epoch, step, lr_at(step), params)
                tokens += sum(min(len(s["input_ids"]), cfg.max_length) for s in batch)
                batch = []
                if last and (step % cfg.log_every == 0 or step + 1 == total_steps):
                    elapsed = time.perf_counter() - start
                    last.update(step=step, epoch=epoch, tok_per_sec=tokens / elapsed, elapsed_s=elapsed, noise_std=0.0)
                    log_file.write(json.dumps(last) + "\n")
                    log_file.flush()
                    log(f"step {step} loss {last['loss']:.4f} acc {last['accuracy']:.3f} streak {last['avg_streak']:.2f}")
                step += 1
                if step >= total_steps:
                    break
            if step >= total_steps:
                break
    finally:
        log_file.close()
    drafter.eval()
    export_drafter(drafter, out / "drafter")
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    return {"steps": step, "last": last, "out": str(out)}


def _step(drafter, opt, batch, cfg, gamma, epoch, step, lr, params) -> dict:
    pieces = []
    for sample in batch:
        g = torch.Generator().manual_seed(hash((cfg.seed, epoch, int(sample["sample_id"]))) & 0x7FFFFFFF)
        got = sequence_blocks(drafter, sample, cfg, gamma, g)
        if got is not None:
            pieces.append(got)
    if not pieces:
        return {}
    logits = torch.cat([p[0] for p in pieces])
    labels = torch.cat([p[1] for p in pieces])
    weights = torch.cat([p[2] for p in pieces])
    loss = weighted_ce(logits, labels, weights)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    metrics = block_metrics(logits.detach(), labels, weights)
    return {"loss": float(loss.detach()), **metrics, "lr": lr, "grad_norm": float(grad_norm)}
