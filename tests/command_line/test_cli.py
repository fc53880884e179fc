"""The `pipeline` command line: commands, options, honest refusals, clear errors."""

import json
import shutil
import subprocess

import pytest
from harness.runs import cli
from typer.testing import CliRunner

from cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args), env={"COLUMNS": "160", "NO_COLOR": "1"})


def test_help_lists_the_stages():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("extract", "train", "verify-cache", "demo", "target-info"):
        assert command in result.output


@pytest.mark.parametrize("command, options", [
    ("extract", ["--shards", "--config", "--target", "--data", "--cache", "--num-shards", "--top-k", "--tp"]),
    ("train", ["--cache", "--config", "--preset", "--target", "--out"]),
    ("verify-cache", ["--shards", "--target", "--recompute", "--sample-rate", "--show", "--json"]),
    ("eval", ["--device", "--dtype", "--tree-budget", "--tree-verify", "--batch-size", "--json"]),
])
def test_stage_options_are_documented(command, options):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    for option in options:
        assert option in result.output, f"{command} --help lacks {option}"


def test_help_texts_survive_rich_markup():
    """Rich reads "[word]" in a help text as a style tag and prints nothing for it: every help text
    must render with all its brackets (escape them as "\\[")."""
    import typer.main
    from rich.text import Text
    group = typer.main.get_command(app)
    texts = []
    for name, command in group.commands.items():
        texts += [(name, command.help or "")] + [(f"{name} {p.name}", getattr(p, "help", None) or "") for p in command.params]
    for where, text in texts:
        assert Text.from_markup(text).plain.count("[") == text.replace("\\[", "[").count("["), (where, text)
    assert "([extract] table)" in " ".join(invoke("extract", "--help").output.split())
    assert "([train] table)" in " ".join(invoke("train", "--help").output.split())


@pytest.mark.parametrize("args, message", [
    (["--cache", "{tmp}/nope"], "{tmp}/nope: no such cache directory"),
    (["--cache", "{tmp}", "--loss", "mse"], "loss 'mse': each term is NAME or COEF*NAME with NAME one of ce, kl, tv, nla, lk"),
    (["--cache", "{tmp}", "--batch-sequences", "0"], "batch_sequences must be >= 1, got 0"),
    (["--cache", "{tmp}", "--preset", "huge"], "unknown preset 'huge'; available: qwen3.6-27b, tiny"),
    (["--config", "{tmp}/train.toml"], "{tmp}/train.toml: unknown key(s) learning_rate in [train]; its tables are [train.job], [train.data]"),
])
def test_train_bad_input_is_one_clear_line(tmp_path, args, message):
    (tmp_path / "train.toml").write_text("[train]\nlearning_rate = 0.1\n")
    result = invoke("train", *[a.format(tmp=tmp_path) for a in args])
    assert result.exit_code == 1, result.output
    assert message.format(tmp=tmp_path) in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_target_info_summarises_the_embedded_target():
    result = invoke("target-info", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["class"] == "Qwen3_5ForCausalLM"
    assert summary["num_hidden_layers"] == 8
    assert summary["default_taps_3"] == [1, 3, 5]
    assert summary["mask_token_id"] is not None
    assert summary["build"]["heldout_accuracy"] >= 0.9
    assert summary["self_agreement"]["agreement"] >= 0.98


def test_target_info_human_output_is_a_table():
    result = invoke("target-info")
    assert result.exit_code == 0, result.output
    assert "Qwen3_5ForCausalLM" in result.output and "agreement" in result.output


NETWORK_GUARD = """
import os, socket

def _refuse(*args, **kwargs):
    with open(os.environ["NETWORK_ATTEMPTS"], "a") as f:
        f.write(repr(args[1:]) + "\\n")
    raise OSError("network access refused by the test")

for _name in ("connect", "connect_ex", "sendto"):
    _orig = getattr(socket.socket, _name)
    def _guarded(self, *args, _orig=_orig):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            return _refuse(self, *args)
        return _orig(self, *args)
    setattr(socket.socket, _name, _guarded)
socket.getaddrinfo = _refuse
"""


def test_quick_demo_runs_the_whole_pipeline(tmp_path):
    """Every stage (extract, verify-cache, train, eval, report) with the network refused and
    logged, and the hub allowed (HF_HUB_OFFLINE=0): nothing may need or try a connection."""
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(NETWORK_GUARD)
    attempts = tmp_path / "network-attempts.log"
    env = {"PYTHONPATH": str(guard), "NETWORK_ATTEMPTS": str(attempts), "HF_HUB_OFFLINE": "0"}
    result = cli("demo", "--quick", "--block-size", "16", "--out", str(tmp_path / "demo"), "--json", env=env)
    assert not attempts.exists(), attempts.read_text()
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    assert summary["verify"]["passed"] and summary["eval"]["lossless"]
    assert summary["train"]["steps"] == 40 and summary["eval"]["prompts"] == 6
    assert summary["train"]["block_size"] == 16  # the flagship's block size instead of the preset's 8
    assert json.loads((tmp_path / "demo" / "run" / "drafter" / "config.json").read_text())["block_size"] == 16
    assert json.loads((tmp_path / "demo" / "run" / "run.json").read_text())["config"]["objective"]["gamma"] == 7.0  # DESIGN 3.4
    assert summary["cache"]["bytes_per_token"] > 0 and len(summary["report"]["plots"]) == 5
    assert summary["report"]["plots"][-1].endswith("report-tau-by-kind.png")
    kinds = summary["eval"]["by_kind"]
    assert sum(k["prompts"] for k in kinds.values()) == 6 and set(kinds) <= {"thinking", "non_thinking", "tool_call"}
    for stage in ("[1/5] extract", "[3/5] train", "[5/5] report"):
        assert stage in result.stderr
    assert json.loads((tmp_path / "demo" / "demo.json").read_text())["eval"] == summary["eval"]


def test_target_info_on_a_bad_directory_is_one_clear_line(tmp_path):
    result = invoke("target-info", str(tmp_path))
    assert result.exit_code == 1
    assert f"{tmp_path}: not a target model directory (no config.json)" in result.output
    assert "Traceback" not in result.output


def test_target_info_names_a_missing_config_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", "num_hidden_layers": 4}))
    result = invoke("target-info", str(tmp_path))
    assert result.exit_code == 1
    assert "missing field 'hidden_size'" in result.output


def test_console_script_is_installed():
    exe = shutil.which("pipeline")
    assert exe, "the `pipeline` console script is not on PATH (pip install the package)"
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "verify-cache" in result.stdout


def test_a_hub_id_is_refused_with_a_download_hint():
    result = invoke("target-info", "Qwen/Qwen3.6-27B")
    assert result.exit_code == 1
    assert "looks like a Hub id" in result.output and "hf download Qwen/Qwen3.6-27B" in result.output


def test_progress_lines_in_a_log_are_spaced_and_say_how_far(capsys):
    """The plain-line progress of a non-terminal: a line per crossed step of the total, never two
    within the minimum interval, with count, percentage, rate and ETA."""
    from pipeline.ui import ProgressBar

    with ProgressBar("work", "items", total=10, enabled=True, every_percent=20, min_interval_s=0) as bar:
        for _ in range(10):
            bar.advance(1, tokens=100)
    lines = capsys.readouterr().err.splitlines()
    assert [x.split()[1] for x in lines] == ["2/10", "4/10", "6/10", "8/10", "10/10"], lines
    assert "(100%)" in lines[-1] and "items/s" in lines[-1] and "tok/s" in lines[-1] and "eta" in lines[0]
    with ProgressBar("work", "items", total=10, enabled=True, every_percent=20, min_interval_s=3600) as bar:
        for _ in range(10):
            bar.advance(1)
    assert capsys.readouterr().err == ""  # seconds of work: quiet
