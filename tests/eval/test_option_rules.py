"""Each option rule of `pipeline eval` and `pipeline generate` is written once and fires from the
command line as one line and exit code 1: the sampling options in pipeline/sampler.py
(`check_sampling`, which `Sampler` runs too), the drafter's block in pipeline/drafter/config.py
(`check_block_size`, run by `DrafterConfig` and its `at_block`). An eval at a shorter block drafts
with a view of the drafter and leaves the loaded one as trained."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from harness.runs import REPO, cli, cli_here
from pipeline.errors import PipelineError
from pipeline.sampler import Sampler, check_sampling

# (temperature, top_p, top_k) -> the one line both commands print.
BAD_SAMPLING = [
    ((-1.0, 1.0, 0), "--temperature must be >= 0 (0: greedy), got -1.0"),
    ((float("nan"), 1.0, 0), "--temperature must be >= 0 (0: greedy), got nan"),
    ((1.0, 1.5, 0), "--top-p must be in (0, 1], got 1.5"),
    ((1.0, 0.0, 0), "--top-p must be in (0, 1], got 0.0"),
    ((1.0, 1.0, -2), "--top-k must be >= 0 (0: off), got -2"),
    ((0.0, 0.9, 0), "--top-p 0.9 shapes sampling: give --temperature > 0 with it (0 is greedy)"),
    ((0.0, 0.9, 5), "--top-p 0.9 and --top-k 5 shape sampling: give --temperature > 0 with them (0 is greedy)"),
]


@pytest.mark.parametrize(("options", "message"), BAD_SAMPLING)
def test_the_sampling_rule_is_the_samplers(options, message):
    """check_sampling is the rule; a Sampler built with the same options refuses them alike."""
    with pytest.raises(PipelineError) as checked:
        check_sampling(*options)
    assert str(checked.value) == message
    if options[0] > 0:
        with pytest.raises(PipelineError) as built:
            Sampler(*options)
        assert str(built.value) == message


def test_a_sampler_at_temperature_zero_is_refused_and_good_options_pass():
    with pytest.raises(PipelineError, match="^--temperature 0 is greedy decoding"):
        Sampler(0.0)
    for options in ((0.0, 1.0, 0), (0.7, 0.95, 0), (1.0, 1.0, 40)):
        check_sampling(*options)


def _error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_both_commands_refuse_bad_sampling_options_in_one_line_before_reading_anything(tmp_path):
    """Neither the drafter, the data nor a model exists: the sampling rule fires first."""
    missing = str(tmp_path / "missing")
    commands = {
        "eval": lambda t, p, k: ["eval", "--drafter", missing, "--temperature", t, "--top-p", p, "--top-k", k],
        "generate": lambda t, p, k: ["generate", "--data", missing + ".jsonl", "--out", str(tmp_path / "o.jsonl"),
                                     "--temperature", t, "--top-p", p],
    }
    for (temperature, top_p, top_k), message in BAD_SAMPLING:
        for name, args in commands.items():
            if name == "generate" and top_k:       # generate samples without top-k
                continue
            result = cli_here(*args(str(temperature), str(top_p), str(top_k)))
            assert result.returncode == 1, (name, result.stderr)
            assert _error_lines(result) == [f"error: {message}"], (name, result.stderr)
    assert not (tmp_path / "o.jsonl").exists()


def test_a_bad_sampling_option_exits_non_zero_from_a_real_process(tmp_path):
    result = cli("generate", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o.jsonl"),
                 "--top-p", "0.5")
    assert result.returncode == 1
    assert _error_lines(result) == ["error: --top-p 0.5 shapes sampling: give --temperature > 0 with it (0 is greedy)"]


# Each rule's message stems, and the one file under pipeline/ and stages/ that may write them.
RULES = {
    "pipeline/sampler.py": ["--temperature must", "--top-p must", "--top-k must", "shape sampling", "shapes sampling"],
    "pipeline/drafter/config.py": ["block this drafter was trained on", "block_size must be", "--block-size must"],
}
# Where eval and generate live (the training config checks its own block option: pipeline/config.py).
SCANNED = ["pipeline/sampler.py", "pipeline/drafter", "pipeline/eval", "pipeline/generate", "stages/eval", "stages/generate"]


def test_each_rule_is_written_in_one_file():
    sources = [f for root in SCANNED for f in ([REPO / root] if root.endswith(".py") else (REPO / root).rglob("*.py"))]
    for home, stems in RULES.items():
        for stem in stems:
            writers = sorted(str(f.relative_to(REPO)) for f in sources if stem in f.read_text(encoding="utf-8"))
            assert writers in ([], [home]), (stem, writers)
    # No loaded config's block is assigned: a shorter block is a new config (DrafterConfig.at_block).
    for source in sources:
        assert not re.search(r"\.block_size\s*=(?!=)", source.read_text(encoding="utf-8")), source


def _random_export(path: Path, embedded, block: int) -> Path:
    """A drafter export at the embedded target's width, random weights (acceptance does not matter here)."""
    from transformers import AutoConfig

    from pipeline.drafter.export import export_drafter
    from pipeline.drafter.model import DFlashDrafter, DrafterConfig
    from pipeline.target_model import frozen_target_modules

    facts = AutoConfig.from_pretrained(embedded.TARGET_DIR)
    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=facts.hidden_size, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=facts.vocab_size,
                           target_layer_ids=[1, 3], num_target_layers=facts.num_hidden_layers,
                           mask_token_id=facts.vocab_size - 1, block_size=block)
    embed, head = frozen_target_modules(embedded.TARGET_DIR)
    export_drafter(DFlashDrafter(config, embed=embed, lm_head=head), path)
    return path


@pytest.fixture(scope="module")
def export(tmp_path_factory, embedded):
    return _random_export(tmp_path_factory.mktemp("export") / "drafter", embedded, block=8)


def test_an_eval_at_a_shorter_block_leaves_the_loaded_drafter_as_trained(export, monkeypatch):
    import stages.eval.run as eval_run
    from stages.eval.options import EvalOptions

    loaded = []

    def recording_load(*args, **kwargs):
        drafter = real_load(*args, **kwargs)
        loaded.append((drafter, copy.deepcopy(drafter.config)))
        return drafter

    real_load = eval_run.load_drafter
    monkeypatch.setattr(eval_run, "load_drafter", recording_load)
    result = eval_run.run_eval(EvalOptions(drafter=export, target="embedded", max_new_tokens=6, block_size=4, tree_budget=[4], limit=1))
    assert result["block_size"] == 4 and result["block"]["tokens"] > 0
    (drafter, before), = loaded
    assert drafter.config == before and drafter.config.block_size == 8


def test_the_block_size_rule_fires_from_the_command_line_in_one_line(export):
    for block in ("9", "1", "0"):
        result = cli_here("eval", "--drafter", str(export), "--target", "embedded", "--block-size", block,
                          "--limit", "1")
        assert result.returncode == 1, result.stderr
        assert _error_lines(result) == [f"error: --block-size must be in 2..8 (the block this drafter was trained on), "
                                        f"got {block}"], result.stderr
