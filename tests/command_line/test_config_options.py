"""Options declared once: each `option(...)` field of a command's options dataclass (and of
ExtractConfig / TrainConfig) is its command's `--NAME` (pipeline/ui/options.py). Checked against
flag lists written out by hand (the options the commands had when each one was spelled in cli.py)
and on a small command built here."""

import dataclasses

import pytest
import typer
from typer.testing import CliRunner

from cli import app
from pipeline.config import ExtractConfig, TrainConfig, int_list, option, token_or_id
from pipeline.ui.options import command

runner = CliRunner()

# Written out by hand: every option `train` and `extract` took before they were derived.
TRAIN_FLAGS = ["--cache", "--preset", "--target", "--out", "--max-steps", "--num-epochs", "--lr", "--batch-sequences",
               "--micro-batch-sequences", "--num-anchors", "--block-size", "--num-hidden-layers", "--loss",
               "--position-weight", "--dpace-alpha", "--noise-std", "--dtype", "--attention", "--seed", "--log-every",
               "--checkpoint-every", "--allow-mixed-provenance", "--allow-incomplete-cache", "--cache-local",
               "--cache-local-size", "--mask-token", "--report-to", "--verdict-every"]
EXTRACT_FLAGS = ["--target", "--data", "--cache", "--num-shards", "--layers", "--top-k", "--hidden-format",
                 "--max-length", "--overlong", "--on-error", "--reasoning", "--generated-by", "--batch-tokens", "--tp",
                 "--shard-locks", "--no-shard-locks"]
# Written out by hand: every flag of the other commands when cli.py spelled each one (typer.Option
# by typer.Option), plus their positional arguments.
OTHER_FLAGS = {
    "generate": ["--data", "--out", "--target", "--server", "--model", "--concurrency", "--shards", "--num-shards",
                 "--turns", "--max-new-tokens", "--temperature", "--top-p", "--seed", "--batch-size", "--device",
                 "--dtype", "--on-error", "--json"],
    "eval": ["--drafter", "--target", "--prompts", "--max-new-tokens", "--block-size", "--tree-budget", "--tree-top-k",
             "--report-to", "--tree-verify", "--batch-size", "--limit", "--cache", "--device", "--dtype", "--group-by",
             "--temperature", "--top-p", "--top-k", "--seed", "--outputs", "--json"],
    "report": ["logs", "--window", "--every", "--epochs", "--steps-per-epoch", "--reference-tau", "--out", "--follow",
               "--interval", "--eval", "--json"],
    "verify-cache": ["cache", "--shards", "--target", "--recompute", "--tail-rate", "--device", "--dtype",
                     "--sample-rate", "--show", "--seed", "--json"],
    "demo": ["--out", "--quick", "--no-quick", "--report-to", "--block-size", "--json"],
    "cache-info": ["cache", "--draft-vocab", "--config", "--max-length", "--energy", "--energy-tokens", "--json"],
    "target-info": ["path", "--data", "--json"],
}


def declared_flags(command: str) -> set[str]:
    """The flags click knows for a command of the real app."""
    group = typer.main.get_command(app)
    return {flag for param in group.commands[command].params for flag in param.opts + param.secondary_opts}


@pytest.mark.parametrize("command, flags", [("train", TRAIN_FLAGS), ("extract", EXTRACT_FLAGS)])
def test_every_config_option_is_a_flag_with_help(command, flags):
    known = declared_flags(command)
    assert set(flags) <= known, sorted(set(flags) - known)
    assert "--no-allow-mixed-provenance" not in known  # a False-by-default switch is one flag
    group = typer.main.get_command(app)
    for param in group.commands[command].params:
        assert param.help, f"{command} {param.opts} has no help"


@pytest.mark.parametrize("command_name", sorted(OTHER_FLAGS))
def test_every_command_keeps_its_flags_each_with_help(command_name):
    group = typer.main.get_command(app)
    params = [p for p in group.commands[command_name].params if p.name != "help"]
    declared = {o for p in params for o in p.opts + p.secondary_opts if o.startswith("--") or p.param_type_name == "argument"}
    assert declared == set(OTHER_FLAGS[command_name])
    for param in params:
        assert param.param_type_name == "argument" or param.help, f"{command_name} {param.opts} has no help"


# A shared option where a command means more by it than its block says (the command's OWN_HELP),
# with words of what cli.py said of it before the blocks: what --seed draws, which shards --shards
# writes, what --device and --dtype run.
OWN_MEANINGS = {("generate", "--seed"): "(seed, row, turn)", ("generate", "--shards"): "writes",
                ("extract", "--shards"): "writes", ("verify-cache", "--seed"): "the sampled chunks and samples",
                ("verify-cache", "--device"): "the model checks run", ("verify-cache", "--dtype"): "for the checks",
                ("eval", "--seed"): "the prompt's index only", ("eval", "--dtype"): "Target and drafter"}
SHARED = {"--device": "device", "--dtype": "dtype", "--seed": "seed", "--shards": "shards", "--json": "json_out"}


def help_of_flag(command_name: str, flag: str) -> str:
    group = typer.main.get_command(app)
    return next(p.help for p in group.commands[command_name].params if flag in p.opts)


def test_a_shared_option_says_what_its_block_says_unless_the_command_means_more():
    """--device, --dtype, --seed, --shards and --json are declared once (stages/options.py); train's
    --dtype (autocast) and --seed (init, data order, anchors) are TrainConfig's own."""
    from stages.options import Device, JsonOutput, Seeded, ShardSelection

    declared = {f.name: f.metadata["help"] for block in (Device, Seeded, ShardSelection, JsonOutput)
                for f in dataclasses.fields(block)}
    group = typer.main.get_command(app)
    seen = set()
    for name, cmd in group.commands.items():
        for param in cmd.params:
            flag = param.opts[0]
            if flag not in SHARED or (name, flag) in OWN_MEANINGS or (name == "train" and flag in ("--dtype", "--seed")):
                continue
            assert param.help == declared[SHARED[flag]], (name, flag)
            seen.add(flag)
    assert seen == {"--device", "--dtype", "--shards", "--json"}  # every command words its own --seed


@pytest.mark.parametrize("command_name, flag", sorted(OWN_MEANINGS))
def test_a_shared_option_says_what_it_means_in_its_command(command_name, flag):
    assert OWN_MEANINGS[(command_name, flag)] in help_of_flag(command_name, flag)


def test_demo_quick_keeps_its_off_switch():
    assert {"--quick", "--no-quick"} <= declared_flags("demo")


# Every flag of train and extract today, written out by hand: a flag added, renamed or lost
# fails test_the_flag_set_of_every_command_is_pinned (OTHER_FLAGS pins the other commands').
PINNED_FLAGS = {
    "train": ["--allow-incomplete-cache", "--allow-mixed-provenance", "--attention", "--batch-sequences", "--betas",
              "--block-size", "--cache", "--cache-local", "--cache-local-size", "--checkpoint-every", "--config",
              "--dpace-alpha", "--draft-vocab", "--dtype", "--gamma", "--grad-clip", "--head-dim", "--intermediate-size",
              "--json", "--keep-checkpoints", "--layer-types", "--loader-workers", "--log-every", "--loss", "--lr",
              "--mask-token", "--max-length", "--max-position-embeddings", "--max-steps", "--micro-batch-sequences",
              "--min-lr-ratio", "--mix-shards", "--no-resume", "--noise-schedule", "--noise-std", "--num-anchors",
              "--num-attention-heads", "--num-epochs", "--num-hidden-layers", "--num-key-value-heads", "--out",
              "--position-weight", "--prefetch", "--preset", "--projected-fc", "--report-to", "--resume", "--rope-theta",
              "--seed", "--sliding-window", "--target", "--target-layer-ids", "--verdict-every", "--warmup-ratio",
              "--warmup-steps", "--weight-decay"],
    "extract": ["--assume-compression", "--assume-tokens-per-s", "--batch-tokens", "--cache", "--compute-dtype",
                "--config", "--data", "--dry-run", "--end-of-turn", "--generated-by", "--hidden-format", "--json",
                "--layers", "--max-length", "--no-shard-locks", "--no-thinking", "--num-shards", "--on-error",
                "--overlong", "--pilot-tokens", "--project-taps", "--reasoning", "--shard-locks", "--shards", "--target",
                "--thinking", "--top-k", "--tp", "--writer-queue", "--zstd-level"],
}
# Settings a TOML file may hold that no flag can: tables, which a flag's text would spell badly.
FILE_ONLY = {ExtractConfig: {"chat_template_kwargs", "chunking"}, TrainConfig: set()}


@pytest.mark.parametrize("command_name", sorted(PINNED_FLAGS))
def test_the_flag_set_of_every_command_is_pinned(command_name):
    assert declared_flags(command_name) - {"--help"} == set(PINNED_FLAGS[command_name])


@pytest.mark.parametrize("cls", [ExtractConfig, TrainConfig])
def test_every_setting_but_a_table_is_a_flag_with_help(cls):
    """A user may change on the command line whatever the file may hold, but the tables."""
    from pipeline.ui.options import option_fields

    flagged = {f.name for f in option_fields(cls)}
    every = set(settings_of(cls))
    assert every - flagged == FILE_ONLY[cls]
    assert all(f.metadata["help"].strip() for f in option_fields(cls))


def test_a_setting_is_named_once_across_train_components():
    """The flags are flat, so no two components may hold a setting of the same name."""
    names = [f.name for part in dataclasses.fields(TrainConfig) for f in dataclasses.fields(part.default_factory())]
    assert len(names) == len(set(names)) == 52


def settings_of(cls) -> list[str]:
    """Every setting of a config: a flat one's fields, a composed one's components' fields."""
    fields = dataclasses.fields(cls)
    if all(f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory()) for f in fields):
        return [g.name for f in fields for g in dataclasses.fields(f.default_factory())]
    return [f.name for f in fields]


@dataclasses.dataclass(kw_only=True)
class Toy:
    count: int = option(3, help="A count.")
    ratio: float = option(0.5, help="A ratio.")
    name: str | None = option(None, help="A name.")
    items: list[str] = option(factory=list, help="Repeatable.")
    ids: list[int] | None = option(None, parse=int_list, help="Comma-separated ids.")
    token: str | int = option("<m>", parse=token_or_id, help="A token or its id.")
    strict: bool = option(False, help="A switch, off by default.")
    locks: bool = option(True, help="A switch, on by default.")
    hidden: int = 7                                       # no option(...): TOML only


@dataclasses.dataclass(kw_only=True)
class ToyOwn:
    loud: bool = option(False, help="The command's own.")


def toy_app(seen: list):
    toy = typer.Typer()

    @toy.command()
    @command(ToyOwn, config=Toy)
    def run(options: ToyOwn, overrides: dict) -> None:
        seen.append((overrides, options.loud))

    @toy.command()
    def other() -> None:  # a second command keeps typer from folding `run` into the app itself
        pass
    return toy


def test_given_options_arrive_parsed_and_the_rest_as_none():
    seen = []
    args = ["run", "--count", "4", "--items", "a", "--items", "b", "--ids", "1, 3,5", "--token", "248070",
            "--strict", "--no-locks", "--loud"]
    result = runner.invoke(toy_app(seen), args)
    assert result.exit_code == 0, result.output
    assert seen == [({"count": 4, "ratio": None, "name": None, "items": ["a", "b"], "ids": [1, 3, 5], "token": 248070,
                      "strict": True, "locks": False}, True)]
    seen.clear()
    assert runner.invoke(toy_app(seen), ["run", "--token", "<|MASK|>", "--ratio", "0.25"]).exit_code == 0
    assert seen == [({"count": None, "ratio": 0.25, "name": None, "items": None, "ids": None, "token": "<|MASK|>",
                      "strict": None, "locks": None}, False)]


def test_flags_follow_the_field_and_undeclared_fields_are_not_options():
    seen = []
    result = runner.invoke(toy_app(seen), ["run", "--hidden", "3"])
    assert result.exit_code == 2 and "No such option: --hidden" in result.output
    assert runner.invoke(toy_app(seen), ["run", "--no-strict"]).exit_code == 2      # no off-switch for False
    assert runner.invoke(toy_app(seen), ["run", "--count", "x"]).exit_code == 2     # typer checks the type
    help_text = runner.invoke(toy_app(seen), ["run", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}).output
    for flag, text in [("--count", "A count."), ("--ids", "Comma-separated ids."), ("--locks", "A switch, on by default.")]:
        assert flag in help_text and text in help_text


@dataclasses.dataclass(kw_only=True)
class Block:
    seed: int = option(0, help="Any command's seed.")


@dataclasses.dataclass(kw_only=True)
class Worded(Block):
    OWN_HELP = {"seed": "This command's seed: what it draws."}
    fast: bool = option(False, negatable=True, help="A switch off by default, with its off-switch.")


def test_a_command_words_a_shared_option_itself_and_a_switch_may_keep_its_off_switch():
    seen = []
    worded = typer.Typer()

    @worded.command()
    @command(Worded)
    def run(options: Worded) -> None:
        seen.append(options)

    @worded.command()
    def other() -> None:
        pass

    help_text = runner.invoke(worded, ["run", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}).output
    assert "This command's seed: what it draws." in help_text and "Any command's seed." not in help_text
    assert "--no-fast" in help_text
    assert runner.invoke(worded, ["run", "--fast", "--no-fast"]).exit_code == 0 and seen[-1].fast is False
    assert runner.invoke(worded, ["run", "--fast"]).exit_code == 0 and seen[-1].fast is True


def test_own_help_names_an_option_of_its_command():
    @dataclasses.dataclass(kw_only=True)
    class Misspelt(Block):
        OWN_HELP = {"sede": "A typo."}

    with pytest.raises(TypeError, match="Misspelt.OWN_HELP: sede"):
        command(Misspelt)


def test_an_option_the_cli_cannot_type_is_refused_when_declared():
    @dataclasses.dataclass(kw_only=True)
    class Bad:
        table: dict = option(factory=dict, help="A table.")

    with pytest.raises(TypeError, match="Bad.table"):
        command(ToyOwn, config=Bad)


def test_a_bad_option_value_is_one_line_naming_the_flag(tmp_path):
    result = runner.invoke(app, ["extract", "--cache", str(tmp_path / "c"), "--layers", "1,x"],
                           env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 1
    assert result.output.strip() == "error: --layers: '1,x' is not a comma-separated list of integers"
    assert not (tmp_path / "c").exists()
