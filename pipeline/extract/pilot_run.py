"""The basis of a projected cache (`extract --project-taps R`), fitted once, before any shard.

The pilot is the first `--pilot-tokens` tokens of the plan's rows, shard 0 onwards (whatever
shards this invocation writes, so every launcher means the same tokens), run through the target
once more for their taps alone (no logits). The basis is fitted on rank 0 and stored in the cache
if it has none (create-if-absent: of launchers racing, one basis wins and all use it); a cache
that holds one already (a resume, a second launcher) never refits. Every rank then reads the
stored basis, so a cache's shards are all in one basis (DESIGN 5).

Under torchrun rank 0 decides whether to fit; then the ranks of its tensor-parallel group run
the pilot's forwards with it (they are collectives), and the other ranks wait for its result. A
failure there (out of memory, a bad row) is that result: rank 0 sends it to every rank, which
stops at once with one line naming it, instead of waiting in the broadcast until the process
group's timeout. A tensor-parallel peer's own failure reaches rank 0 the same way, when it fails
outside a collective; one stuck in a collective because its peer failed is ended by torchrun
(the group's ranks share a node and its agent).
"""

from __future__ import annotations

import time

import torch

from pipeline.cache.identity import ProjectionRecord
from pipeline.cache.shard_plan import shard_rows
from pipeline.data.samples import length_batches, prepare_samples
from pipeline.distributed import broadcast_from_rank0, decided_on_rank0
from pipeline.errors import PipelineError
from pipeline.faults import failpoint
from pipeline.projection.basis import SecondMoment, TapBasis, fit_basis
from pipeline.projection.basis_file import read_basis, store_basis
from pipeline.target_model.capture import right_padded, tapped_layers


def pilot_description(tokens: int) -> str:
    return f"the first {tokens} tokens of the plan's rows, shard 0 onwards (taps concatenated, uncentred)"


def pilot_samples(cfg, paths, masker, facts, index, num_rows: int) -> list[tuple[int, list[int]]]:
    """(sample id, token ids) of the pilot: samples in row order until `pilot_tokens`; the last one
    cut to fit."""
    out, tokens = [], 0
    for shard in range(cfg.num_shards):
        samples, _ = prepare_samples(cfg, paths, shard_rows(shard, num_rows, cfg.num_shards), masker,
                                     facts.vocab_size, index)
        for sid, ids, _mask in sorted(samples, key=lambda s: s[0]):
            take = ids[:cfg.pilot_tokens - tokens]
            out.append((sid, take))
            tokens += len(take)
            if tokens >= cfg.pilot_tokens:
                return out
    return out


@torch.no_grad()
def forward_pilot_moment(model, taps: list[int], width: int, samples, batch_tokens: int, *, accumulate: bool,
                         progress=None) -> SecondMoment:
    """Run the pilot's samples through the target (taps only) and sum their second moment, one
    addition a batch (its real tokens gathered on the device: no host copy a sample)."""
    device = next(model.parameters()).device
    moment = SecondMoment(width, device=device)
    for batch in length_batches([(sid, ids, None) for sid, ids in samples], batch_tokens):
        tokens = [ids for _, ids, _ in batch]
        with tapped_layers(model, taps) as captured:
            model.model(input_ids=right_padded(tokens, 0).to(device), use_cache=False)
        failpoint("pilot.forward")
        if accumulate:
            stacked = captured.stacked()
            moment.add(torch.cat([stacked[row, :len(ids)] for row, ids in enumerate(tokens)]).reshape(-1, width).float())
        if progress is not None:
            progress(sum(len(ids) for ids in tokens))
    return moment


def _group_failures(layout, failed: BaseException | None) -> list[str]:
    """On rank 0: how the pilot's forwards failed on the other ranks of its tensor-parallel group
    ("rank R (Type: first line)"); [] elsewhere, and where none failed."""
    if layout.tp == 1 or layout.dp_rank != 0:
        return []
    import torch.distributed as dist

    mine = None if failed is None else (f"rank {layout.rank} ({type(failed).__name__}: "
                                        f"{next(iter(str(failed).splitlines()), '')})")
    said = [None] * layout.tp
    dist.all_gather_object(said, mine, group=layout.tp_group)
    return [s for s in said[1:] if s]


def projection_basis(cfg, *, location, layout, model, taps, inputs,
                     progress=None) -> tuple[TapBasis, ProjectionRecord, dict]:
    """(the cache's basis, its record for the identity, what was done: fitted or read, seconds).
    A basis the cache holds already is used as it is, whatever --pilot-tokens says now."""
    start = time.perf_counter()
    world = layout.world_size
    stored = decided_on_rank0(lambda: read_basis(location) is not None, rank=layout.rank, world=world,
                              what="looking for the cache's basis")
    fitted, forwards, fit_seconds = None, 0.0, 0.0
    if not stored:
        moment, failed = None, None
        if layout.dp_rank == 0:
            try:
                samples = pilot_samples(cfg, inputs.paths, inputs.masker, inputs.facts, inputs.dataset["index"],
                                        inputs.dataset["num_rows"])
                moment = forward_pilot_moment(model, taps, len(taps) * inputs.facts.hidden_size, samples,
                                              cfg.batch_tokens, accumulate=layout.rank == 0, progress=progress)
            except Exception as e:  # noqa: BLE001 - every rank must hear of it, not only this one
                failed = e
        peers = _group_failures(layout, failed)
        forwards = time.perf_counter() - start

        def fit() -> str:
            if failed is not None:  # rank 0's own: raised as it is (its traceback), the others told in one line
                raise failed
            if peers:
                raise PipelineError(f"the pilot's forwards failed on {'; '.join(peers)}")
            basis = fit_basis(moment, cfg.project_taps)
            return store_basis(location, basis, pilot_description(moment.tokens)).digest()
        fitted = decided_on_rank0(fit, rank=layout.rank, world=world, what="running the pilot and fitting the tap basis")
        fit_seconds = time.perf_counter() - start - forwards
    basis = read_basis(location)
    failpoint("pilot.basis")  # stored, and no manifest yet: a kill here must leave a cache that resumes
    if basis is None:
        raise PipelineError(f"{location.where()}: the tap basis vanished after it was stored")
    if fitted is not None and basis.digest() != fitted:
        raise PipelineError(f"{location.where()}: the stored basis changed while this extract read it")
    if basis.projected_rank != cfg.project_taps or basis.width != len(taps) * inputs.facts.hidden_size:
        raise PipelineError(f"{location.where('basis.safetensors')}: the cache's basis projects "
                            f"{basis.width} values to {basis.projected_rank}, this extract asks --project-taps "
                            f"{cfg.project_taps} of {len(taps) * inputs.facts.hidden_size}: use the cache's "
                            "settings or another --cache")
    broadcast_from_rank0(None, world)  # every rank has read it before any shard is written
    record = ProjectionRecord(rank=basis.projected_rank, digest=basis.digest(), energy=basis.energy,
                              pilot_tokens=basis.pilot_tokens, pilot=pilot_description(basis.pilot_tokens))
    return basis, record, {"basis": "fitted" if not stored else "read from the cache", "energy": basis.energy,
                           "pilot_tokens": basis.pilot_tokens, "seconds": time.perf_counter() - start,
                           "forward_seconds": forwards, "fit_seconds": fit_seconds}
