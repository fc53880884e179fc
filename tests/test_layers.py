"""The floors of the house (README, layout): cli -> stages -> pipeline. The library never imports a
stage or the CLI, and a stage never imports another stage; `pipeline demo` composes the others
by calling their public entry points (`run_*`, and train's `resolve_config`) and is the one
exception. Every import counts, function-local ones too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = "stages/demo.py"
ENTRY_POINTS = {"resolve_config"}  # besides run_*: what demo may take from another stage


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


def test_a_stage_imports_no_other_stage_and_demo_only_their_entry_points():
    offenders = []
    for p in sorted((ROOT / "stages").glob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        for line, module, names in imports(p):
            if top(module) == "cli":
                offenders.append(f"{rel}:{line} imports the CLI")
            if top(module) != "stages" or module == "stages" and not names:
                continue
            if module in ("stages", f"stages.{p.stem}"):
                continue
            allowed = rel == DEMO and names and all(n.startswith("run_") or n in ENTRY_POINTS for n in names)
            if not allowed:
                offenders.append(f"{rel}:{line} imports {module} ({', '.join(names) or 'the module'})")
    assert not offenders, offenders


def test_the_rule_catches_what_it_forbids(tmp_path):
    """The checks above see function-local imports and `from stages import x` forms."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from stages.train import frozen_target_modules\n    from stages import eval\n"
                      "import cli\n")
    seen = [(module, names) for _, module, names in imports(sample)]
    assert ("stages.train", ["frozen_target_modules"]) in seen
    assert ("stages.eval", []) in seen
    assert ("cli", []) in seen


def test_the_cli_imports_without_torch():
    """`pipeline --help` and a mistyped option answer at once: importing the CLI loads no stage
    that imports torch (each command imports its own stage when it runs)."""
    import subprocess
    import sys

    probe = "import sys, cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
