"""The floors of the house (README, layout): cli -> stages -> pipeline. The library never imports a
stage or the CLI, and a command's folder of stages/ never imports another's (stages/options.py,
the option blocks they share, is for all); `pipeline demo` composes the others by calling their
public entry points (`run_*`, train's `resolve_config`, the options eval and verify-cache take)
and is the one exception. Every import counts, function-local ones too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = "demo"
# Besides run_*: what demo may take from another stage (train's config resolution, the options
# eval and verify-cache take).
ENTRY_POINTS = {"resolve_config", "EvalOptions", "VerifyOptions"}


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names taken from it) for every import statement in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [alias.name for alias in node.names]
            found.append((node.lineno, node.module, names))
            # `from stages import train` imports the module stages.train
            found += [(node.lineno, f"{node.module}.{n}", []) for n in names if node.module in ("stages", "pipeline")]
    return found


def top(module: str) -> str:
    return module.split(".")[0]


def test_the_library_imports_no_stage_and_not_the_cli():
    offenders = [f"{p.relative_to(ROOT)}:{line} imports {module}"
                 for p in sorted((ROOT / "pipeline").rglob("*.py"))
                 for line, module, _ in imports(p) if top(module) in ("stages", "cli")]
    assert not offenders, offenders


def stage_of(module: str) -> str | None:
    """stages.eval.run -> 'eval': the command a module of stages/ belongs to (None: the shared
    stages.options)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] != "options") else None


def test_a_stage_imports_no_other_stage_and_demo_only_their_entry_points():
    offenders = []
    for p in sorted((ROOT / "stages").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        mine = stage_of(module_name(p))
        for line, module, names in imports(p):
            if top(module) == "cli":
                offenders.append(f"{rel}:{line} imports the CLI")
            if top(module) != "stages" or module == "stages" and not names:
                continue
            theirs = stage_of(module)
            if theirs is None or theirs == mine:
                continue
            allowed = mine == DEMO and names and all(n.startswith("run_") or n in ENTRY_POINTS for n in names)
            if not allowed:
                offenders.append(f"{rel}:{line} imports {module} ({', '.join(names) or 'the module'})")
    assert not offenders, offenders


def test_the_rule_catches_what_it_forbids(tmp_path):
    """The checks above see function-local imports and `from stages import x` forms."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from stages.train.run import frozen_target_modules\n    from stages import eval\n"
                      "import cli\n")
    seen = [(module, names) for _, module, names in imports(sample)]
    assert ("stages.train.run", ["frozen_target_modules"]) in seen
    assert ("stages.eval", []) in seen
    assert ("cli", []) in seen
    assert [stage_of(m) for m in ("stages.train.run", "stages.eval", "stages.options")] == ["train", "eval", None]


def test_the_cli_imports_without_torch():
    """`pipeline --help` and a mistyped option answer at once: importing the CLI loads no stage
    that imports torch (each command imports its own stage when it runs)."""
    import subprocess
    import sys

    probe = "import sys, cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# The library's packages by job, from the top down (README, layout). A package imports only the
# floors below its own; packages on one floor are independent of each other, except on the
# ground floor (small shared modules). Every import counts, function-local ones too.
FLOORS = [
    ("independent", ["pipeline.toy"]),
    # evaluation: its teacher-forced walk takes training's batches and metrics
    ("independent", ["pipeline.eval"]),
    ("independent", ["pipeline.extract", "pipeline.verify", "pipeline.training", "pipeline.generate"]),
    # projected taps: the basis fitted on a cache's pilot, which extract, train and verify take
    ("independent", ["pipeline.projection"]),
    ("independent", ["pipeline.cache", "pipeline.data"]),
    ("independent", ["pipeline.target_model"]),
    ("independent", ["pipeline.provenance", "presets"]),
    ("independent", ["pipeline.tracking"]),
    ("independent", ["pipeline.report"]),
    ("independent", ["pipeline.ui"]),
    ("independent", ["pipeline.records"]),
    ("independent", ["pipeline.drafter"]),
    # every package reads its settings; the settings import nothing of the library but its errors
    ("independent", ["pipeline.config"]),
    ("shared", ["pipeline.allocator", "pipeline.devices", "pipeline.distributed", "pipeline.embedded",
                "pipeline.errors", "pipeline.faults", "pipeline.files", "pipeline.timing_machine", "pipeline.schedule",
                "pipeline.sampler", "pipeline.threads",
                "pipeline"]),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> dict[str, Path]:
    paths = sorted((ROOT / "pipeline").rglob("*.py")) + sorted((ROOT / "presets").glob("*.py"))
    return {module_name(p): p for p in paths}


def package_of(module: str) -> str | None:
    """The floor plan's package that holds `module` (the longest listed prefix)."""
    found = [name for _, names in FLOORS for name in names if module == name or module.startswith(name + ".")]
    return max(found, key=len) if found else None


def floor_of(package: str) -> int:
    return next(i for i, (_, names) in enumerate(FLOORS) if package in names)


def internal_imports(known: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the library modules it imports (a `from package import name` of a submodule counts
    as importing that submodule)."""
    edges: dict[str, set[str]] = {}
    for module, path in known.items():
        targets = set()
        for _, imported, names in imports(path):
            for candidate in [f"{imported}.{n}" for n in names] + [imported]:
                while candidate and candidate not in known and "." in candidate:
                    candidate = candidate.rsplit(".", 1)[0]
                if candidate in known and candidate != module:
                    targets.add(candidate)
                    break
        edges[module] = targets
    return edges


def floor_violations(edges: dict[str, set[str]]) -> list[str]:
    offenders = []
    for module, targets in sorted(edges.items()):
        here = package_of(module)
        if here is None:
            offenders.append(f"{module} is on no floor: add its package to FLOORS")
            continue
        for target in sorted(targets):
            there = package_of(target)
            if there is None or there == here:
                continue
            mine, theirs = floor_of(here), floor_of(there)
            if theirs < mine:
                offenders.append(f"{module} imports {target}: {there} is on a floor above {here}")
            elif theirs == mine and FLOORS[mine][0] == "independent":
                offenders.append(f"{module} imports {target}: {here} and {there} share a floor and are independent")
    return offenders


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle among modules once (Tarjan's strongly connected components of size > 1)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_each_package_imports_only_the_floors_below_it():
    offenders = floor_violations(internal_imports(library_modules()))
    assert not offenders, "\n".join(offenders)


def test_no_import_cycles_among_modules():
    known = library_modules()
    for p in sorted((ROOT / "stages").rglob("*.py")) + [ROOT / "cli.py"]:
        known[module_name(p)] = p
    found = cycles(internal_imports(known))
    assert not found, found


def test_the_floor_and_cycle_rules_catch_what_they_forbid():
    """Hand-made graphs: an upward import, two independent packages on one floor, a cycle."""
    upward = {"pipeline.cache.reader": {"pipeline.training.loop"}, "pipeline.training.loop": set()}
    assert floor_violations(upward) == ["pipeline.cache.reader imports pipeline.training.loop: "
                                        "pipeline.training is on a floor above pipeline.cache"]
    sideways = {"pipeline.verify.x": {"pipeline.extract.y"}, "pipeline.extract.y": set()}
    assert "independent" in floor_violations(sideways)[0]
    shared = {"pipeline.devices": {"pipeline.distributed"}, "pipeline.distributed": set()}
    assert floor_violations(shared) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def kit_offenders(root: Path) -> list[str]:
    """Imports that break the kit's rule: the package (pipeline/, stages/, cli.py) imports neither
    the test kit (harness/) nor a test module; a benchmark imports no test module (tests/ holds
    tests and their fixtures only; what tests and benchmarks share lives in harness/)."""
    test_modules = {p.stem for p in (root / "tests").rglob("*.py")} | {"tests"}
    package = sorted((root / "pipeline").rglob("*.py")) + sorted((root / "stages").rglob("*.py")) + [root / "cli.py"]
    found = [f"{p.relative_to(root).as_posix()}:{line} imports {module}"
             for p in package for line, module, _ in imports(p) if top(module) in test_modules | {"harness"}]
    found += [f"{p.relative_to(root).as_posix()}:{line} imports the test module {module}"
              for p in sorted((root / "benchmarks").rglob("*.py")) + sorted((root / "harness").glob("*.py"))
              for line, module, _ in imports(p) if top(module) in test_modules]
    return found


def test_the_package_and_the_benchmarks_import_no_test_module():
    offenders = kit_offenders(ROOT)
    assert not offenders, "\n".join(offenders)


def test_the_kit_rule_catches_what_it_forbids(tmp_path):
    for folder, text in (("pipeline", "from harness.runs import cli\n"), ("benchmarks", "def f():\n    import conftest\n"),
                         ("tests", "")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "x.py").write_text(text)
    (tmp_path / "stages").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text("")
    (tmp_path / "cli.py").write_text("import json\n")
    assert kit_offenders(tmp_path) == ["pipeline/x.py:1 imports harness.runs",
                                       "benchmarks/x.py:2 imports the test module conftest"]
