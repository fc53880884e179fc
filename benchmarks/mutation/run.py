"""Mutation testing of the modules where a silent bug costs a GPU week (issue 81): per module, how
many of cosmic-ray's mutants the mapped tests kill, which are equivalent and why, which survive.

    python benchmarks/mutation/run.py [MODULE ...] [--work DIR] [--source DIR] [--rev REV [--also PATH ...]]
        [--tests FILE[#SECTION] | FILE::TEST ...] [--sample N] [--seed 0] [--survivors-only] [--fresh]
        [--timeout-factor 3] [--min-timeout 120] [--equivalent FILE] [--report-only] [--list] [--json]

MODULE: a path from the mapping below (`--list` prints it), or a group: `cache`, `verify`,
`training`, `data`, `drafter`, `eval`, `all` (default: cache and verify).

Needs cosmic-ray 8.x in the interpreter that runs this script (`pip install cosmic-ray==8.7.0`;
not a project dependency). What it does, per module:

1. Copies the repository into `--work`/repo, fresh on every invocation: the files git tracks plus
   the untracked ones it does not ignore, as they are in `--source` (default: this checkout), or
   with `--rev` the files of that commit (plus `--also` paths from the working tree). cosmic-ray
   edits the module on disk while a mutant's tests run: in the copy, never in the checkout.
2. Writes cosmic-ray's configuration into `--work`/sessions (never into pyproject.toml): the
   module, and as its test command pytest over the tests MAPPING lists for that module, in that
   order, with `-x` (a mutant is killed at its first failing test; only survivors pay for every
   file). An entry is a test file, a pytest node id (FILE::TEST), or FILE#SECTION: the test
   functions under that section header of the file (the guard files have one section per module
   guarded), so a module's own cheap guards run first (pytest runs with --keep-duplicates, so a
   node id listed before its whole file runs where it is listed). The mapping is explicit rather than coverage-derived: coverage only says
   which tests *execute* a line, and every extract-based test executes most of the cache's code,
   so it would select nearly every slow test; the mapping picks the tests that *check* the
   module, cheapest first, and leaves out suites about other things (S3, kill -9) unless the
   module has code only they reach.
3. Runs the mapped tests once unmutated (they must pass; their time sets the per-mutant timeout:
   `--timeout-factor` x that, at least `--min-timeout` s), then `cosmic-ray init` and `exec`
   (one mutant at a time: cosmic-ray's local distributor, one pytest process per mutant, torch on
   one thread, the whole run under `nice -n 19`).
4. Writes `--work`/results/<module>.json and table.md: per module the mutants of this operator
   set, killed, timeouts (the mutant made the tests hang: killed), equivalent (listed in
   `--equivalent`, default benchmarks/mutation/equivalent.toml, each with its reason, or
   equivalent by rule: an operator inside an annotation, which `from __future__ import
   annotations` never evaluates), survived (the rest, each with its diff), incompetent (the
   mutant or the runner failed; should be 0), pending.

The operator set: cosmic-ray's core operators, less redundant replacements (KEPT_* below): each
arithmetic operator becomes its nearest neighbours only (+ <-> -, * <-> /, // -> / and *, % -> //,
** -> *, << <-> >>, | <-> &, ^ -> |) instead of all 11 others, each comparison its boundary and
its negation (< -> <= and >=, == -> !=, is -> is not, ...) instead of all 7, each unary operator
its removal (and - <-> ~); the number, boolean, and/or, not, break/continue, exception, decorator
and zero-iteration operators stay whole. The replacements left out crash on the same line as a
kept one (a str - str) or say less (x << y for x + y): 3,808 mutants became 1,317 on the cache and
verify modules when the set was chosen.

One `--work` per concurrent run: each invocation copies the tree into `--work`/repo afresh, which
would pull the files from under another run's mutant (to run two modules at once, give each a
work folder; a session moves with its `sessions/<module>.*` files).

Resumable: sessions stay in `--work`/sessions; a rerun continues a module's pending mutants
(`--fresh` starts over; a module whose source changed since its session was made gets a new
one). `--survivors-only` re-runs the mutants that survived, except those listed as equivalent
(a killed mutant stays killed: tests were only added). `--sample N` runs N mutants per module,
chosen at random (`--seed`), to measure seconds per mutant and project the full run; the table
then counts those only.

The cheap way to a full table (what BENCHMARKS reports): first each module with its own guards
only (`--tests tests/cache/test_cache_mutation_guards.py`, or the verify guard file's section),
seconds a mutant; then `--survivors-only` with the mapping. A mutant the guards kill is killed by
the mapping too (its first tests are those guards, under -x), so only the guards' survivors pay
for the slow extract-based files.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import io
import json
import os
import random
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# Module -> the test files that check it, cheapest and most likely to kill first (pytest -x stops at
# the first failure, so only a survivor runs them all). Paths relative to the repository root.
MAPPING: dict[str, dict] = {
    # -- the cache ---------------------------------------------------------------------------------
    "pipeline/cache/schema.py": {
        "group": "cache",
        "tests": ["tests/cache/test_cache_mutation_guards.py", "tests/cache/test_array_names.py",
                  "tests/cache/test_cache_encoding.py", "tests/cache/test_cache_layout.py",
                  "tests/cache/test_untrusted_input.py"],
        "why": "the layout formulae (chunk and file sizes, file keys, dims bounds) and the array table",
    },
    "pipeline/cache/writer.py": {
        "group": "cache",
        "tests": ["tests/cache/test_cache_mutation_guards.py", "tests/cache/test_cache_layout.py",
                  "tests/cache/test_untrusted_input.py", "tests/cache/test_faults.py"],
        "why": "test_faults for the storage-error path (disk full, file-size limit), last: minutes",
    },
    "pipeline/cache/reader.py": {
        "group": "cache",
        "tests": ["tests/cache/test_cache_mutation_guards.py", "tests/cache/test_cache_layout.py",
                  "tests/cache/test_untrusted_input.py", "tests/cache/test_manifest_record.py",
                  "tests/cache/test_mixed_identity.py"],
        "why": "ranges, declared shapes, missing files, foreign shards",
    },
    # -- verify-cache's checks ---------------------------------------------------------------------
    **{f"pipeline/verify/{name}_checks.py": {
        "group": "verify",
        "tests": [f"tests/verify/test_verify_mutation_guards.py#{section}", "tests/verify/test_verify.py",
                  "tests/verify/test_verify_samples.py", "tests/verify/test_projected_verify.py"],
        "why": "the guards' section for the module, then verify-cache's planted faults, whole and per sample, "
               "and the projected cache",
    } for name, section in (("structure", "structure,provenance"), ("selection", "selection"),
                            ("sample", "sample checks"), ("label", "labels"), ("chunk", "chunks"),
                            ("model", "model checks' parts,model checks with the target"))},
    "pipeline/verify/tap_alignment.py": {
        "group": "verify",
        "tests": ["tests/verify/test_verify_mutation_guards.py#model checks' parts,model checks with the target",
                  "tests/verify/test_verify.py", "tests/verify/test_projected_verify.py"],
        "why": "the recompute's judge of where stored taps came from (whole and projected), moved out of model_checks",
    },
    # -- training, data, drafter, eval ------------------------------------------------------------
    "pipeline/training/blocks.py": {
        "group": "training", "tests": ["tests/training/test_blocks.py", "tests/training/test_loss.py",
                                       "tests/training/test_objectives.py", "tests/drafter/test_drafter.py"],
        "why": "anchors, block layout, labels and soft targets worked by hand"},
    "pipeline/training/batch.py": {
        "group": "training", "tests": [
            "tests/training/test_pack.py", "tests/training/test_blocks.py", "tests/training/test_step_noise.py",
            "tests/projection/test_projected_noise.py", "tests/training/test_loss.py",
            *(f"tests/training/test_draft_vocab.py::{t}" for t in (
                "test_the_whole_vocabulary_as_a_draft_vocabulary_changes_no_bit",
                "test_the_loss_with_k_below_v_is_the_full_vocabulary_one_with_the_excluded_logits_removed")),
            "tests/training/test_micro_batches.py", "tests/training/test_flex_step.py"],
        "why": "batch assembly from cached samples (the placeholder, a draft vocabulary), and the context noise the step adds"},
    "pipeline/training/loss.py": {
        "group": "training", "tests": ["tests/training/test_loss.py", "tests/training/test_plain_ce.py",
                                       "tests/training/test_objectives.py", "tests/training/test_draft_vocab.py"],
        "why": "CE / KL objectives, masks, weighting"},
    "pipeline/data/loss_mask.py": {
        "group": "data", "tests": ["tests/data/test_loss_mask.py", "tests/data/test_mask_violations.py",
                                   "tests/verify/test_verify_mutation_guards.py#sample checks",
                                   "tests/data/test_chat_shapes.py"],
        "why": "DESIGN 3.5's mask rule, and the stored-mask check verify-cache runs with it"},
    "pipeline/drafter/model.py": {
        "group": "drafter", "tests": [
            "tests/drafter/test_drafter.py", "tests/drafter/test_incremental.py", "tests/drafter/test_attention_rule.py",
            "tests/drafter/test_reference_export.py", "tests/training/test_loss.py", "tests/training/test_flex_step.py",
            "tests/training/test_draft_vocab.py::test_the_whole_vocabulary_as_a_draft_vocabulary_changes_no_bit"],
        "why": ("the drafter against the reference implementation; the attention path it picks and the head's "
                "weight as training's loss reads them")},
    "pipeline/drafter/attention_rule.py": {
        "group": "drafter", "tests": [
            "tests/drafter/test_attention_rule.py", "tests/drafter/test_drafter.py", "tests/drafter/test_incremental.py",
            "tests/training/test_loss.py", "tests/training/test_flex_step.py"],
        "why": "the attention rule's masks and training's attention paths (split, flex, compiled) against dense SDPA"},
    "pipeline/eval/speculative_sampling.py": {
        "group": "eval", "tests": [
            "tests/eval/test_sampling_keys.py", "tests/eval/test_ties.py", *(f"tests/eval/test_sampling.py::{t}" for t in (
                "test_warping_matches_transformers_logits_processors", "test_draw_is_inverse_transform_sampling",
                "test_keyed_uniforms_are_uniform_and_independent_of_each_other",
                "test_one_block_slot_catches_planted_faults[None]")),
            "tests/eval/test_sampling.py"],
        "why": "the acceptance rule and its keys (milliseconds), then its distribution: the slot test (seconds) before the decoding tests"},
    "pipeline/eval/speculative_decoding.py": {
        "group": "eval", "tests": [
            "tests/eval/test_sampling_keys.py", "tests/eval/test_ties.py", *(f"tests/eval/test_eval.py::{t}" for t in (
                "test_tree_is_best_first_within_its_budget", "test_tree_verify_auto_follows_its_rule",
                "test_the_prefill_state_continues_as_a_full_forward_and_the_drafter_gets_the_prompts_taps",
                "test_a_tree_walk_follows_the_targets_choices_and_commits_the_path_it_accepts",
                "test_ddtree_follows_an_oracle_tree_to_its_depth_and_decodes_the_greedy_tokens",
                "test_decoding_drafts_through_the_drafters_kv_cache_unless_asked_not_to",
                "test_a_prompt_sampled_alone_is_prompt_0_of_a_batch",
                "test_rejection_rolls_back_the_recurrent_state_exactly",
                "test_commit_from_the_verify_pass_equals_rerunning_the_accepted_tokens",
                "test_tree_verification_processes_each_node_once_and_equals_the_batched_paths",
                "test_plain_decoding_of_a_batch_equals_one_prompt_at_a_time",
                "test_an_oracle_drafter_reaches_the_block_size_and_an_untrained_one_about_one")),
            "tests/drafter/test_reference_decoding.py", "tests/eval/test_eval.py", "tests/eval/test_sampling.py"],
        "why": "lossless decoding against greedy: the tests without a trained drafter first (it takes minutes)"},
}
GROUPS = sorted({m["group"] for m in MAPPING.values()})
DEFAULT_GROUPS = ("cache", "verify")

# Operators left out (regular expressions over cosmic-ray's operator names; see the docstring).
_ARITHMETIC = "(Add|Sub|Mul|Div|FloorDiv|Mod|Pow|RShift|LShift|BitOr|BitAnd|BitXor)"
KEPT_BINARY = {("Add", "Sub"), ("Sub", "Add"), ("Mul", "Div"), ("Div", "Mul"), ("FloorDiv", "Div"),
               ("FloorDiv", "Mul"), ("Mod", "FloorDiv"), ("Pow", "Mul"), ("LShift", "RShift"),
               ("RShift", "LShift"), ("BitOr", "BitAnd"), ("BitAnd", "BitOr"), ("BitXor", "BitOr")}
KEPT_COMPARISON = {("Lt", "LtE"), ("Lt", "GtE"), ("LtE", "Lt"), ("LtE", "Gt"), ("Gt", "GtE"), ("Gt", "LtE"),
                   ("GtE", "Gt"), ("GtE", "Lt"), ("Eq", "NotEq"), ("NotEq", "Eq"), ("Is", "IsNot"),
                   ("IsNot", "Is")}
KEPT_UNARY = {"Delete_Not", "Delete_USub", "Delete_Invert", "Delete_UAdd", "USub_Invert", "Invert_USub"}


def operator_kept(name: str) -> bool:
    """Whether this operator set runs cosmic-ray's operator `name` (e.g. core/ReplaceBinaryOperator_Add_Mul)."""
    if m := re.fullmatch(rf"core/ReplaceBinaryOperator_{_ARITHMETIC}_{_ARITHMETIC}", name):
        return (m.group(1), m.group(2)) in KEPT_BINARY
    if m := re.fullmatch(r"core/ReplaceComparisonOperator_(\w+?)_(\w+)", name):
        return (m.group(1), m.group(2)) in KEPT_COMPARISON
    if m := re.fullmatch(r"core/ReplaceUnaryOperator_(\w+)", name):
        return m.group(1) in KEPT_UNARY
    return True


ANNOTATION_RULE = "inside an annotation: `from __future__ import annotations` keeps it a string, never evaluated"


def annotation_lines(source: str) -> set[tuple[int, int, int, int]]:
    """(first line, first column, last line, end column) of every annotation in a module that
    defers them (`from __future__ import annotations`); empty otherwise."""
    tree = ast.parse(source)
    deferred = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and
                   any(a.name == "annotations" for a in n.names) for n in tree.body)
    if not deferred:
        return set()
    spans = set()
    for node in ast.walk(tree):
        found = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append(node.returns)
            found += [a.annotation for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                                             node.args.vararg, node.args.kwarg) if a is not None]
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
        spans |= {(a.lineno, a.col_offset, a.end_lineno, a.end_col_offset) for a in found if a is not None}
    return spans


def in_span(row: int, col: int, spans) -> bool:
    """Whether source position (row, col), 1-based row as parso gives it, lies in one of `spans`."""
    return any((r0, c0) <= (row, col) < (r1, c1) for r0, c0, r1, c1 in spans)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the copy ------------------------------------------------------------------------------------------

def copy_repository(source: Path, dest: Path, rev: str | None, also: list[str]) -> None:
    """A fresh copy of the repository at `dest` (see the docstring, step 1)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if rev is not None:
        archive = subprocess.run(["git", "-C", str(source), "archive", rev], capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")
        paths = also
    else:
        listed = subprocess.run(["git", "-C", str(source), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                capture_output=True, check=True).stdout
        paths = [p for p in listed.decode().split("\0") if p]
    for rel in paths:
        src = source / rel
        if src.is_file():  # a tracked file deleted in the working tree is left out
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


# -- cosmic-ray's session ----------------------------------------------------------------------------

def expand_tests(repo: Path, entries: list[str]) -> tuple[list[str], list[str]]:
    """(pytest arguments, entries missing from the copy). An entry is a test file, or
    `FILE#SECTION[,SECTION]`: the test functions of FILE under those section headers (a comment
    line `# ---...--- SECTION`), in file order: a module's own guards, run before the rest; or a
    pytest node id (`FILE::TEST`)."""
    args, missing = [], []
    for entry in entries:
        path, _, sections = entry.partition("#")
        if not (repo / path.partition("::")[0]).is_file():
            missing.append(entry)
            continue
        if not sections:
            args.append(path)
            continue
        wanted, current, found = {x.strip() for x in sections.split(",")}, None, []
        for line in (repo / path).read_text().splitlines():
            if m := re.fullmatch(r"# -{3,} (.+?)(?: -*)?", line.strip()):
                current = m.group(1).strip()
            elif (m := re.match(r"def (test_\w+)\(", line)) and current in wanted:
                found.append(f"{path}::{m.group(1)}")
        if not found:
            raise SystemExit(f"{entry}: no test functions under those section headers")
        args += found
    return args, missing


def slug(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def test_command(python: str, tests: list[str], basetemp: Path) -> list[str]:
    # --keep-duplicates: without it pytest drops a FILE::TEST that a later FILE argument also
    # covers, and runs the whole file in its own order, so the cheap tests listed first would not
    # run first. With it a survivor runs them twice (seconds).
    return [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--keep-duplicates",
            f"--basetemp={basetemp}", *tests]


def write_config(path: Path, module: str, command: list[str], timeout: float) -> None:
    lines = ["[cosmic-ray]", f"module-path = {json.dumps(module)}", f"timeout = {timeout:.1f}",
             "excluded-modules = []", f"test-command = {json.dumps(shlex.join(command))}", "",
             "[cosmic-ray.distributor]", 'name = "local"', ""]
    path.write_text("\n".join(lines))


SITE = None   # the folder of the sitecustomize.py below, on every test process's path (set in main)

# cosmic-ray's exception operator writes `except CosmicRayTestingException:` into the module (a
# handler that matches nothing) but defines that name only in its own process: in the tests'
# processes the clause would raise NameError as soon as an exception reached it, which is another
# mutant (and kills some that the intended one leaves alive). Every test process (pytest, and the
# `python -m cli` it starts) gets the name as a builtin through this sitecustomize.
SITECUSTOMIZE = """import builtins


class CosmicRayTestingException(Exception):
    \"\"\"What cosmic-ray's exception operator puts in an except clause: never raised.\"\"\"


builtins.CosmicRayTestingException = CosmicRayTestingException
"""


def test_env() -> dict:
    """One worker, one thread: cosmic-ray runs one mutant at a time; torch must not take both cores."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "COLUMNS": "200", "NO_COLOR": "1"}
    if SITE is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH")) if p)
    return env


def baseline(repo: Path, module: str, command: list[str]) -> float:
    """Seconds the mapped tests take unmutated; they must pass. The module's own bytecode is removed
    afterwards (cosmic-ray runs mutants with PYTHONDONTWRITEBYTECODE, so a mutant never meets a
    stale .pyc of the original; the other modules' bytecode stays, saving each mutant the compile)."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=repo, env=test_env(), capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{module}: the mapped tests fail unmutated (exit {done.returncode}); fix that first:\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    remove_bytecode(repo, module)
    return seconds


def remove_bytecode(repo: Path, module: str) -> None:
    for pyc in (repo / module).parent.glob(f"__pycache__/{Path(module).stem}.*.pyc"):
        pyc.unlink()


def cosmic_ray(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cosmic_ray.cli", *args], cwd=cwd, env=test_env(),
                          capture_output=True, text=True, check=False)


def prepare_session(repo: Path, module: str, config: Path, session: Path, meta_path: Path, *, fresh: bool,
                    survivors_only: bool, sample: int | None, seed: int, equivalents: list[dict]) -> dict:
    """Create (or reuse) the module's session and mark what this run skips; returns its metadata."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    source = (repo / module).read_text()
    digest = hashlib.sha256(source.encode()).hexdigest()
    meta = json.loads(meta_path.read_text()) if meta_path.exists() and session.exists() else None
    if meta is not None and meta.get("sha256") != digest:
        log(f"{module}: the module changed since its session was made: a new session")
        meta = None
    if fresh or meta is None:
        session.unlink(missing_ok=True)
        done = cosmic_ray("init", str(config), str(session), cwd=repo)
        if done.returncode != 0:
            raise SystemExit(f"{module}: cosmic-ray init failed:\n{done.stderr[-3000:]}")
        spans = annotation_lines(source)
        meta = {"sha256": digest, "made": time.strftime("%Y-%m-%d %H:%M:%S")}
        with use_db(str(session), WorkDB.Mode.open) as db:
            for item in list(db.pending_work_items):
                m = item.mutations[0]
                if not operator_kept(m.operator_name):
                    db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output="operator left out"))
                elif in_span(*m.start_pos, spans):
                    db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED,
                                                          output="equivalent by rule: " + ANNOTATION_RULE))
    with sqlite3.connect(session) as db:
        # A previous --sample's choice does not bind this run; nor does a survivor, with --survivors-only.
        db.execute("DELETE FROM work_results WHERE output = 'not in the sample'")
        if survivors_only:
            # A listed equivalent survives any test by its reason: it keeps its result and is not re-run.
            survivors = db.execute("SELECT s.job_id, s.operator_name, r.diff FROM work_results r JOIN mutation_specs s "
                                   "ON s.job_id = r.job_id WHERE r.test_outcome = 'SURVIVED'").fetchall()
            rerun = [(j,) for j, operator, diff in survivors
                     if equivalent_reason(module, operator, diff or "", equivalents) is None]
            db.executemany("DELETE FROM work_results WHERE job_id = ?", rerun)
        if sample is not None:
            pending = [r[0] for r in db.execute(
                "SELECT job_id FROM work_items WHERE job_id NOT IN (SELECT job_id FROM work_results) ORDER BY job_id")]
            chosen = set(random.Random(seed).sample(pending, min(sample, len(pending))))
            db.executemany("INSERT INTO work_results (worker_outcome, output, job_id) VALUES ('SKIPPED', "
                           "'not in the sample', ?)", [(j,) for j in pending if j not in chosen])
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


def pending_count(session: Path) -> int:
    with sqlite3.connect(session) as db:
        return db.execute("SELECT count(*) FROM work_items WHERE job_id NOT IN (SELECT job_id FROM work_results)"
                          ).fetchone()[0]


def execute(repo: Path, module: str, config: Path, session: Path, timings: Path) -> None:
    """`cosmic-ray exec`, one mutant at a time, its progress on stderr; each mutant's seconds (from
    the moment its result appears in the session) appended to `timings`."""
    total = pending_count(session)
    if not total:
        return
    log(f"{module}: {total} mutants to run")
    proc = subprocess.Popen([sys.executable, "-m", "cosmic_ray.cli", "exec", str(config), str(session)], cwd=repo,
                            env=test_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: set[str] = set()
    with sqlite3.connect(session) as db:
        seen |= {r[0] for r in db.execute("SELECT job_id FROM work_results")}
    last = time.perf_counter()
    while True:
        finished = proc.poll() is not None
        with sqlite3.connect(session) as db:
            new = [r for r in db.execute("SELECT job_id, test_outcome, output FROM work_results") if r[0] not in seen]
        now = time.perf_counter()
        with open(timings, "a") as f:
            # Results land one at a time (one mutant at a time): the time since the last one.
            f.writelines(json.dumps({"job_id": job_id, "seconds": round((now - last) / len(new), 2),
                                     "outcome": "timeout" if output == "timeout" else (outcome or "").lower()}) + "\n"
                         for job_id, outcome, output in new)
        if new:
            seen |= {r[0] for r in new}
            done = total - pending_count(session)
            log(f"{module}: {done}/{total} ({new[-1][1]}, {(now - last) / len(new):.1f} s)")
            last = now
        if finished:
            break
        time.sleep(2)
    if proc.returncode != 0:
        raise SystemExit(f"{module}: cosmic-ray exec failed:\n{proc.stderr.read()[-3000:]}")


# -- results -------------------------------------------------------------------------------------------

def changed_lines(diff: str) -> tuple[str, str]:
    """The removed and the added lines of a unified diff, whitespace removed (cosmic-ray respaces
    what it replaces: `max(16,` becomes `max( 17,`)."""
    lines = diff.splitlines()
    removed = "\n".join(re.sub(r"\s+", "", l[1:]) for l in lines if l.startswith("-") and not l.startswith("---"))
    added = "\n".join(re.sub(r"\s+", "", l[1:]) for l in lines if l.startswith("+") and not l.startswith("+++"))
    return removed, added


def load_equivalents(path: Path) -> list[dict]:
    """The known-equivalent mutants: [[equivalent]] tables of module, line (the original source
    line), mutated (the line as the mutant has it), reason, and optionally operator and context (a
    line the diff shows unchanged around it, where `line` alone is not unique in the module)."""
    if not path.exists():
        return []
    entries = tomllib.loads(path.read_text()).get("equivalent", [])
    for e in entries:
        missing = {"module", "line", "mutated", "reason"} - set(e)
        if missing:
            raise SystemExit(f"{path}: an entry lacks {sorted(missing)}: {e}")
    return entries


def equivalent_reason(module: str, operator: str, diff: str, entries: list[dict]) -> str | None:
    removed, added = (re.sub(r"\s+", "", x) for x in changed_lines(diff))   # a removed decorator spans lines
    context = {re.sub(r"\s+", "", line) for line in diff.splitlines() if line.startswith(" ")}
    for e in entries:
        if e["module"] == module and e.get("operator", operator) == operator \
                and re.sub(r"\s+", "", e["line"]) == removed and re.sub(r"\s+", "", e["mutated"]) == added \
                and ("context" not in e or re.sub(r"\s+", "", e["context"]) in context):
            return e["reason"]
    return None


def module_results(module: str, session: Path, timings: Path, equivalents: list[dict]) -> dict:
    with sqlite3.connect(session) as db:
        rows = list(db.execute(
            "SELECT s.job_id, s.operator_name, s.start_pos_row, s.definition_name, r.worker_outcome, r.test_outcome, "
            "r.output, r.diff FROM mutation_specs s LEFT JOIN work_results r ON s.job_id = r.job_id"))
    # cosmic-ray stores its outcome enums by name (SKIPPED, NORMAL, KILLED, ...)
    rows = [(*r[:4], (r[4] or "").lower() or None, (r[5] or "").lower() or None, *r[6:]) for r in rows]
    out = {"module": module, "mutants_made": len(rows), "operator_left_out": 0, "not_in_sample": 0, "pending": 0,
           "run": 0, "killed": 0, "timeouts": 0, "equivalent": 0, "survived": 0, "incompetent": 0,
           "equivalent_mutants": [], "survivors": []}
    for job_id, operator, row, definition, worker, test, output, diff in rows:
        if worker is None:
            out["pending"] += 1
        elif worker == "skipped" and output == "operator left out":
            out["operator_left_out"] += 1
        elif worker == "skipped" and output == "not in the sample":
            out["not_in_sample"] += 1
        elif worker == "skipped" and (output or "").startswith("equivalent by rule"):
            out["equivalent"] += 1
            out["equivalent_mutants"].append({"line": row, "operator": operator, "reason": ANNOTATION_RULE})
        elif worker != "normal" or test == "incompetent":
            out["run"] += 1
            out["incompetent"] += 1
            out["survivors"].append({"job_id": job_id, "line": row, "function": definition, "operator": operator,
                                     "status": f"{worker}/{test}", "diff": diff or "", "output": (output or "")[-500:]})
        else:
            out["run"] += 1
            if test == "killed":
                out["timeouts" if output == "timeout" else "killed"] += 1
            elif (reason := equivalent_reason(module, operator, diff or "", equivalents)) is not None:
                out["equivalent"] += 1
                out["equivalent_mutants"].append({"line": row, "function": definition, "operator": operator,
                                                  "reason": reason, "diff": diff})
            else:
                out["survived"] += 1
                out["survivors"].append({"job_id": job_id, "line": row, "function": definition, "operator": operator,
                                         "status": "survived", "diff": diff or ""})
    out["survivors"].sort(key=lambda s: s["line"])
    if timings.exists():
        records = [json.loads(line) for line in timings.read_text().splitlines() if line.strip()]
        mine = {r["job_id"]: r for r in records}  # the latest run of each mutant
        by = {}
        for r in mine.values():
            by.setdefault(r["outcome"], []).append(r["seconds"])
        seconds = [r["seconds"] for r in mine.values()]
        out["seconds"] = {"mutants_timed": len(seconds), "total": round(sum(seconds), 1),
                          "per_mutant": round(sum(seconds) / len(seconds), 1) if seconds else None,
                          **{f"per_{k}": round(sum(v) / len(v), 1) for k, v in by.items() if k}}
    return out


def markdown(results: list[dict]) -> str:
    """The per-module table (mutants of this operator set = killed + timeouts + equivalent + survived
    + incompetent + pending) and every survivor's diff."""
    head = ("| module | mutants | killed | timeouts | equivalent | survived | incompetent | pending | s/mutant |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in results:
        mutants = r["mutants_made"] - r["operator_left_out"] - r["not_in_sample"]
        sample = f" (sample of {mutants + r['not_in_sample']})" if r["not_in_sample"] else ""
        rows.append(f"| {r['module']} | {mutants}{sample} | {r['killed']} | {r['timeouts']} | {r['equivalent']} "
                    f"| {r['survived']} | {r['incompetent']} | {r['pending']} "
                    f"| {(r.get('seconds') or {}).get('per_mutant', '')} |")
    text = head + "\n".join(rows) + "\n"
    for r in results:
        if r["survivors"]:
            text += f"\n### {r['module']}: {len(r['survivors'])} survived or did not run cleanly\n"
            for s in r["survivors"]:
                text += f"\n`{s['operator']}` line {s['line']} in `{s['function']}` ({s['status']}):\n\n```diff\n" \
                        + "\n".join(l for l in s["diff"].splitlines() if not l.startswith(("---", "+++"))) + "\n```\n"
    return text


def resolve(names: list[str]) -> list[str]:
    if not names:
        names = list(DEFAULT_GROUPS)
    modules = []
    for name in names:
        if name == "all":
            modules += list(MAPPING)
        elif name in GROUPS:
            modules += [m for m, v in MAPPING.items() if v["group"] == name]
        elif name in MAPPING:
            modules.append(name)
        else:
            raise SystemExit(f"unknown module or group {name!r}: one of {', '.join(GROUPS)}, all, or --list's paths")
    return list(dict.fromkeys(modules))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="module paths or groups (default: cache verify)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dflash-mutation",
                        help="working directory: the copy, the sessions, the results (default: %(default)s)")
    parser.add_argument("--source", type=Path, default=REPO, help="the checkout to copy (default: this one)")
    parser.add_argument("--rev", help="copy this commit's files instead of the working tree")
    parser.add_argument("--also", nargs="*", default=[], help="with --rev: working-tree paths copied on top")
    parser.add_argument("--tests", nargs="+", help="run these test files (FILE or FILE#SECTION, see expand_tests) "
                        "instead of the mapping's, for every module named")
    parser.add_argument("--sample", type=int, help="run only N mutants per module, chosen at random")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample (default %(default)s)")
    parser.add_argument("--survivors-only", action="store_true", help="re-run only the mutants that survived")
    parser.add_argument("--fresh", action="store_true", help="start every module's session over")
    parser.add_argument("--timeout-factor", type=float, default=3.0,
                        help="a mutant's timeout: this many times the unmutated tests' time (default %(default)s)")
    parser.add_argument("--min-timeout", type=float, default=120.0, help="at least this many seconds (default %(default)s)")
    parser.add_argument("--equivalent", type=Path, default=HERE / "equivalent.toml",
                        help="the known-equivalent mutants (default: benchmarks/mutation/equivalent.toml)")
    parser.add_argument("--report-only", action="store_true", help="write the tables from the sessions, run nothing")
    parser.add_argument("--list", action="store_true", help="print the module -> tests mapping and exit")
    parser.add_argument("--json", action="store_true", help="print the results as JSON, not as a markdown table")
    args = parser.parse_args()
    if args.sample is not None and args.sample < 1:
        parser.error(f"--sample must be at least 1, got {args.sample}")
    if args.timeout_factor <= 0 or args.min_timeout <= 0:
        parser.error("--timeout-factor and --min-timeout must be positive")
    if args.also and not args.rev:
        parser.error("--also goes with --rev")
    modules = resolve(args.modules)
    if args.list:
        for m in modules:
            print(f"{m}\n    {' '.join(MAPPING[m]['tests'])}\n    ({MAPPING[m]['why']})")
        return
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        parser.error("cosmic-ray is not installed in this interpreter: pip install cosmic-ray==8.7.0")
    os.nice(max(0, 19 - os.nice(0)))  # this process and everything it starts: nice -n 19
    work = args.work.resolve()
    if importlib.util.find_spec("sitecustomize") is not None:
        parser.error("this interpreter already has a sitecustomize module, which the script's own would hide")
    global SITE
    SITE = work / "site"
    SITE.mkdir(parents=True, exist_ok=True)
    (SITE / "sitecustomize.py").write_text(SITECUSTOMIZE)
    repo, sessions, results_dir = work / "repo", work / "sessions", work / "results"
    sessions.mkdir(parents=True, exist_ok=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    equivalents = load_equivalents(args.equivalent)
    if not args.report_only:
        copy_repository(args.source.resolve(), repo, args.rev, args.also)
    results, baselines = [], {}
    for module in modules:
        name = slug(module)
        config, session = sessions / f"{name}.toml", sessions / f"{name}.sqlite"
        meta_path, timings = sessions / f"{name}.meta.json", sessions / f"{name}.timings.jsonl"
        if not args.report_only:
            tests, missing = expand_tests(repo, args.tests or MAPPING[module]["tests"])
            if missing:
                log(f"{module}: not in the copy, left out: {' '.join(missing)}")
            command = test_command(sys.executable, tests, work / "pytest-tmp")
            # Modules mapped to the same tests share one unmutated run (the copy does not change in between).
            if tuple(command) not in baselines:
                baselines[tuple(command)] = baseline(repo, module, command)
            else:
                remove_bytecode(repo, module)
            seconds = baselines[tuple(command)]
            timeout = max(args.min_timeout, args.timeout_factor * seconds)
            log(f"{module}: mapped tests pass unmutated in {seconds:.0f} s; mutant timeout {timeout:.0f} s")
            write_config(config, module, command, timeout)
            meta = prepare_session(repo, module, config, session, meta_path, fresh=args.fresh,
                                   survivors_only=args.survivors_only, sample=args.sample, seed=args.seed,
                                   equivalents=equivalents)
            meta.setdefault("baselines", []).append({"seconds": round(seconds, 1), "tests": tests,
                                                      "at": time.strftime("%Y-%m-%d %H:%M:%S")})
            meta_path.write_text(json.dumps(meta, indent=1))
            execute(repo, module, config, session, timings)
        if not session.exists():
            log(f"{module}: no session yet")
            continue
        result = module_results(module, session, timings, equivalents)
        result["tests"] = (json.loads(meta_path.read_text()).get("baselines") or [{}])[-1].get("tests")
        (results_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
        results.append(result)
    (results_dir / "table.md").write_text(markdown(results))
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(markdown(results))


if __name__ == "__main__":
    main()
