"""The benchmark scripts' command lines (issue 31): every option says what it does, and a bad
value ends in argparse's usage and one `error:` line (exit 2), never a traceback."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "benchmarks").rglob("*.py"))  # grouped in folders by what they measure


def options_without_help(path: Path, source: str) -> tuple[int, list[str]]:
    """(add_argument calls in `source`, 'file:line' of those with no help text or an empty one)."""
    calls, missing = 0, []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"):
            continue
        calls += 1
        help_ = next((k.value for k in node.keywords if k.arg == "help"), None)
        # A string must say something; an f-string or a name (argparse.SUPPRESS, for an internal option) is a choice made.
        if help_ is None or isinstance(help_, ast.Constant) and not (isinstance(help_.value, str) and help_.value.strip()):
            missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return calls, missing


def test_every_benchmark_option_has_help():
    assert SCRIPTS, "no benchmarks/**/*.py found"
    total, missing = 0, []
    for path in SCRIPTS:
        calls, lacking = options_without_help(path, path.read_text(encoding="utf-8"))
        total += calls
        missing += lacking
    assert total > len(SCRIPTS), f"only {total} add_argument calls found: the scan is not seeing the parsers"
    assert not missing, "options without help: " + ", ".join(missing)


def test_the_scan_catches_a_missing_or_empty_help():
    source = ('p.add_argument("--a", help="fine")\n'
              'p.add_argument("--b", type=int)\n'
              'p.add_argument("--c", help=" ")\n'
              'p.add_argument("--d", help=argparse.SUPPRESS)\n')
    assert options_without_help(REPO / "x.py", source) == (4, ["x.py:2", "x.py:3"])


@pytest.mark.parametrize("script, args, option", [
    ("decoding/speculative_speed.py", ["--layers", "4"], "--layers"),      # taps fixed at [1, 3, 5]: was an IndexError
    ("decoding/draft_step.py", ["--contexts", "128,abc"], "--contexts"),   # was a ValueError from int()
    ("decoding/odd_prompts.py", ["--out", "{missing}/odd.jsonl"], "--out"),  # was a FileNotFoundError from write_text
])
def test_a_bad_value_ends_in_one_error_line(tmp_path, script, args, option):
    args = [a.format(missing=tmp_path / "no-such-folder") for a in args]
    done = subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"{Path(script).name}: error: {option}"), done.stderr
    assert "usage: " in done.stderr, done.stderr
