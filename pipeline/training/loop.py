"""The training loop: global batches in the stream's epoch order, one optimizer step each, a log
line every `log_every` steps (file, trackers, live verdicts), a checkpoint every
`checkpoint_every` steps and at the end. Resume is exact: it starts from the (step, epoch,
position) a checkpoint recorded (pipeline/training/stream.py makes the order a pure function of
the shards, seed and epoch)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.cache.reader import CacheReader
from pipeline.config import Data, Schedule
from pipeline.records.train_log import LogLine, write_line
from pipeline.records.verdicts import append_verdict
from pipeline.report.live import LiveVerdicts, Verdict
from pipeline.tracking import Trackers
from pipeline.training.checkpoint import Position, unguarded, save_on_all_ranks
from pipeline.training.plan import Plan
from pipeline.training.step import StepRunner
from pipeline.training.stream import SampleStream, StreamState, read_ahead
from pipeline.training.log_line import Interval, log_record


@dataclass
class LoopOutput:
    """What the run's rank 0 wants to know about it: the last log line and the verdicts fired."""
    last: LogLine | None = None
    fired: list[Verdict] = field(default_factory=list)


def train_loop(plan: Plan, reader: CacheReader, trainer: StepRunner, at: Position, *, data: Data, schedule: Schedule,
               record: dict, out: Path, identity: dict, trackers: Trackers, verdicts: LiveVerdicts, log_file, view=None,
               warn=print, guard=unguarded) -> LoopOutput:
    """Run steps until plan.total_steps; `at` is advanced in place. `data` says how samples are
    read, `schedule` when to log and checkpoint; `record` is the run's config as each checkpoint
    keeps it. `log_file` is None on ranks other than 0 (they neither log nor report).
    `guard(what)` raises when the run no longer owns `out` (RunClaim.check): called before each
    log line and checkpoint."""
    result = LoopOutput()
    t_start, interval = time.perf_counter(), Interval()
    while at.step < plan.total_steps:
        stream = SampleStream(reader, seed=trainer.seed, state=StreamState(epoch=at.epoch, position=at.position),
                              rank=trainer.rank, world_size=trainer.world, prefetch=read_ahead(data.prefetch, trainer.device),
                              fields=SampleStream.FIELDS + (SampleStream.SOFT_FIELDS if trainer.soft else ()),
                              transform=trainer.preparer(at.epoch), workers=data.loader_workers,
                              mix_shards=data.mix_shards)
        items = stream.epoch()
        try:
            while at.step < plan.total_steps and at.position + schedule.batch_sequences <= plan.samples_per_epoch:
                wait0 = time.perf_counter()
                batch = [next(items)[1] for _ in range(plan.per_rank)]
                interval.data_wait += time.perf_counter() - wait0
                logging = (at.step + 1) % schedule.log_every == 0 or at.step == 0 or at.step + 1 == plan.total_steps
                stepped = trainer.step(batch, at.step, with_metrics=logging)
                at.step, at.position = at.step + 1, at.position + schedule.batch_sequences
                interval.tokens += stepped["tokens"]
                if logging:
                    result.last = log_record(stepped, trainer, interval, step=at.step, epoch=at.epoch,
                                             position=at.position, plan=plan,
                                             elapsed=at.elapsed0 + time.perf_counter() - t_start)
                    if log_file:
                        guard(f"logging step {at.step}")
                        _report(result, log_file, trackers, verdicts, out, warn)
                    interval = Interval()
                if view:
                    view.update(at.step, result.last.to_json() if logging else None)
                if at.step % schedule.checkpoint_every == 0 or at.step == plan.total_steps:
                    at.tokens0 += trainer.take_tokens()
                    if log_file:  # rank 0: the trackers write into the run directory too
                        guard(f"flushing the trackers before checkpoint step {at.step}")
                    trackers.flush()  # a resume from this checkpoint finds every line before it in the trackers
                    save_on_all_ranks(out, trainer.drafter, trainer.optimizer, keep=schedule.keep_checkpoints, record=record,
                                      step=at.step, epoch=at.epoch,
                                      position=at.position, identity=identity,
                                      elapsed=at.elapsed0 + time.perf_counter() - t_start, tokens=at.tokens0,
                                      rank=trainer.rank, world=trainer.world, device=trainer.device, guard=guard)
        finally:
            items.close()
        if at.position + schedule.batch_sequences > plan.samples_per_epoch:
            at.epoch, at.position = at.epoch + 1, 0
    return result


def _report(result: LoopOutput, log_file, trackers: Trackers, verdicts: LiveVerdicts, out: Path, warn) -> None:
    """One log line: to the file, the trackers, and through the live verdicts."""
    write_line(log_file, result.last)
    trackers.log(result.last.to_json())
    for verdict in verdicts.observe(result.last):
        result.fired.append(verdict)
        warn(verdict.line())
        trackers.event(verdict.step, verdict.cause, verdict.message, verdict.figure)
        append_verdict(out, asdict(verdict))
