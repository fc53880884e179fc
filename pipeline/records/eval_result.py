"""eval's results (`pipeline eval --json`, EVAL.json) as they are written and read: where each
decoding variant's figures sit, and what it is called in tables, plots and tracker scalars.

The variants, in one registry: a kind is either one variant (block: `result["block"]`) or one
per parameter value (DDTree, per node budget: `result["tree"]["<budget>"]`). Everything that
walks eval's results (per-kind and per-field groups, the summary table, trackers, the demo,
`pipeline report`) goes through `variants_in` / `flat_in`, so a new kind is one `Kind` here and
its decoder (pipeline/eval/variants.py)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import PipelineError


@dataclass(frozen=True)
class Kind:
    key: str                      # its place in eval's JSON (and its decoder's name)
    label: str                    # in tables; "{}" takes the parameter
    plot_label: str               # in `pipeline report`'s plots and the demo
    scalar: str                   # tracker and demo scalar names start with it
    parametrised: bool = False    # one variant per value (its results keyed by str(value))
    tracked: tuple[str, ...] = ("tau_pooled",)   # the figures a tracker gets ("speedup": vs the reference)


KINDS = (
    Kind("block", "block", "block", "block", tracked=("tau_pooled", "tau_mean_of_means", "speedup")),
    Kind("tree", "ddtree {}", "DDTree {}", "ddtree{}", parametrised=True),
)


@dataclass(frozen=True)
class Variant:
    kind: Kind
    param: int | None = None

    @property
    def name(self) -> str:
        """Its timing key: "block", "tree8"."""
        return self.kind.key + ("" if self.param is None else str(self.param))

    @property
    def label(self) -> str:
        return self.kind.label.format(self.param)

    @property
    def plot_label(self) -> str:
        return self.kind.plot_label.format(self.param)

    @property
    def scalar(self) -> str:
        return self.kind.scalar.format(self.param)


@dataclass
class EvalResult:
    """One `pipeline eval` run: written by the eval stage (`to_json`, the `--json` document and
    EVAL.json) and read back by everything that reads one (`from_json`: the summary table,
    trackers, the demo, `pipeline report --eval`)."""
    drafter: str
    target: str
    target_differs_from_training: str | None   # None: the same config and weights as the run recorded
    prompts: int
    block_size: int
    max_new_tokens: int
    device: str
    cpu_threads: int
    drafter_kv_cache: bool
    tree_verify: str
    tree_verify_reason: str
    batch_size: int
    sampling: dict | None                      # temperature, top_p, top_k, seed; None: greedy
    reference: dict                            # plain greedy's (plain sampling's) tokens, time, passes
    variants: dict[Variant, dict]              # each variant's figures (pipeline/eval/summary.py)
    # Greedy: every output is greedy's or departs at a tie of the target. Sampled: None, lossless in
    # distribution by the rule (tests/eval/test_sampling.py).
    lossless: bool | None
    by_kind: dict = field(default_factory=dict)
    by_field: dict | None = None
    teacher_forced: dict | None = None         # with --cache: the acceptance walk on the cache
    reported_to: dict | None = None            # with --report-to: trackers and the step
    outputs: str | None = None                 # with --outputs: the file of what each prompt decoded

    @property
    def reference_key(self) -> str:
        return reference_key(bool(self.sampling))

    def to_json(self) -> dict:
        """The document in the order eval has always written it: teacher_forced first (when there),
        the run's settings, the reference under "greedy" or "plain_sampling", each variant where
        `nest` puts it, then lossless and the groups; by_field, reported_to and outputs only when there."""
        names = [f.name for f in dataclasses.fields(self)]
        settings = names[:names.index("reference")]                         # drafter .. sampling
        out = {} if self.teacher_forced is None else {"teacher_forced": self.teacher_forced}
        out.update({name: getattr(self, name) for name in settings})
        out[self.reference_key] = self.reference
        out.update(nest(self.variants))
        out.update(lossless=self.lossless, by_kind=self.by_kind)
        out.update({name: getattr(self, name) for name in ("by_field", "reported_to", "outputs")
                    if getattr(self, name) is not None})
        return out

    @classmethod
    def from_json(cls, raw: dict, where: str = "eval result") -> EvalResult:
        """Needs prompts, lossless and the block's figures; what an older eval did not write yet
        (a setting, the reference, a group) reads as None (or empty)."""
        try:
            names = [f.name for f in dataclasses.fields(cls) if f.name not in ("reference", "variants")]
            plain = {name: raw.get(name) for name in names} | {"prompts": raw["prompts"], "lossless": raw["lossless"]}
            plain["by_kind"] = raw.get("by_kind") or {}
            reference = raw.get(reference_key(bool(raw.get("sampling")))) or {}
            variants = {v: _current(figures) for v, figures in variants_in(raw, strict=True)}
            return cls(reference=reference, variants=variants, **plain)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PipelineError(f"{where}: not a `pipeline eval --json` result (missing or bad field {e})") from None


def reference_key(sampled: bool) -> str:
    """Where the reference's figures (and its outputs in --outputs lines) sit."""
    return "plain_sampling" if sampled else "greedy"


# Where a decoded output departs from greedy other than at a tie, eval writes one record per
# prompt under "mismatches" (pipeline/eval/summary.py). Before issue 57 a list of the same
# prompts' numbers sat beside it as "mismatched_prompts", and before the records (issue 40) it was
# the only list: `_current` reads both shapes as today's.
LEGACY_MISMATCHES = "mismatched_prompts"


def _current(figures: dict) -> dict:
    """A variant's figures as eval writes them now: an older file's `mismatched_prompts` dropped,
    turned into `mismatches` records (prompt only: where it departed was not recorded) when the
    file has no records."""
    if not isinstance(figures, dict) or LEGACY_MISMATCHES not in figures:
        return figures
    current = {k: v for k, v in figures.items() if k != LEGACY_MISMATCHES}
    if "mismatches" not in current:
        current["mismatches"] = [{"prompt": int(i), "position": None, "greedy_token": None, "speculative_token": None,
                                  "gap": None, "tolerance": None, "tie": False} for i in figures[LEGACY_MISMATCHES]]
    return current


def variants_of(params: dict[str, list[int]]) -> list[Variant]:
    """The variants in registry order: each unparametrised kind, each parametrised one at every
    value it is given ({"tree": budgets})."""
    return [v for k in KINDS for v in ([Variant(k, p) for p in params.get(k.key, [])] if k.parametrised else [Variant(k)])]


def nest(per_variant: dict[Variant, object]) -> dict:
    """{variant: value} in eval's JSON shape, in registry order: {"block": value, "tree": {"8":
    value, ...}}; a parametrised kind is present (maybe empty) whenever it is registered."""
    out = {}
    for k in KINDS:
        mine = [(v, value) for v, value in per_variant.items() if v.kind is k]
        if k.parametrised:
            out[k.key] = {str(v.param): value for v, value in mine}
        elif mine:
            out[k.key] = mine[0][1]
    return out


def variants_in(figures: dict, *, strict: bool = False) -> list[tuple[Variant, object]]:
    """The (variant, value) pairs of a dict in eval's JSON shape (an eval result, one of its
    groups, or `pipeline report`'s cut of one), in registry order. A kind it lacks is skipped;
    `strict`: an unparametrised kind (block) it lacks is a KeyError naming it."""
    found = []
    for k in KINDS:
        if k.key not in figures:
            if strict and not k.parametrised:
                raise KeyError(k.key)
            continue
        if k.parametrised:
            found += [(Variant(k, int(p)), value) for p, value in figures[k.key].items()]
        else:
            found.append((Variant(k), figures[k.key]))
    return found


def pooled_taus(figures: dict) -> dict:
    """Each variant's pooled tau, in eval's JSON shape ({"block": 2.6, "tree": {"8": 3.1}}): what
    `pipeline report --eval` keeps of a result or a group. A missing block is a KeyError."""
    return nest({v: float(r["tau_pooled"]) for v, r in variants_in(figures, strict=True)})


def read_decoded_taus(path: Path) -> dict:
    """The decoded figures of an eval result: {file, prompts, lossless, block, tree: {budget: tau},
    by_kind: {kind: {prompts, block, tree}}} (pooled tau). A file that is not one is a one-line error."""
    where = f"--eval {path}"
    try:
        result = EvalResult.from_json(json.loads(path.read_text()), where)
        figures = {"file": str(path), "prompts": int(result.prompts), "lossless": bool(result.lossless),
                   **nest({v: float(f["tau_pooled"]) for v, f in result.variants.items()}),
                   "by_kind": {kind: {"prompts": int(g["prompts"]), **pooled_taus(g)} for kind, g in result.by_kind.items()}}
    except OSError as e:
        raise PipelineError(f"{where}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise PipelineError(f"{where}: not JSON ({e.msg} at line {e.lineno})") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PipelineError(f"{where}: not a `pipeline eval --json` result (missing or bad field {e})") from None
    return figures


def flat(pairs: list[tuple[Variant, dict]], figure: str, prefix: str = "") -> dict[str, float]:
    """One figure of each variant as flat scalars, {"<prefix><scalar>_<figure>": value}: the names
    trackers and the demo summary use (block_tau_pooled, ddtree8_tau_pooled)."""
    return {f"{prefix}{v.scalar}_{figure}": value[figure] for v, value in pairs}


def flat_in(scalars: dict, figure: str) -> list[tuple[Variant, float]]:
    """The (variant, value) pairs of `flat`'s names for one figure found in `scalars`, in registry
    order (parametrised kinds in the order their names stand)."""
    found = []
    for k in KINDS:
        if not k.parametrised:
            if f"{k.scalar}_{figure}" in scalars:
                found.append((Variant(k), scalars[f"{k.scalar}_{figure}"]))
            continue
        pattern = re.compile(re.escape(k.scalar).replace(r"\{\}", r"(\d+)") + "_" + re.escape(figure) + "$")
        found += [(Variant(k, int(m.group(1))), value) for name, value in scalars.items() if (m := pattern.match(name))]
    return found


def grouped_labels(found: list[Variant]) -> str:
    """"block / DDTree 8, 16": each kind once, a parametrised one with its values."""
    parts = []
    for k in KINDS:
        mine = [v for v in found if v.kind is k]
        if mine:
            parts.append(k.plot_label.format(", ".join(str(v.param) for v in mine)) if k.parametrised else k.plot_label)
    return " / ".join(parts)
