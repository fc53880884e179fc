import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The shared kit (harness/, beside tests/ and benchmarks/) is not installed: reach it from the
# repository root, appended so that `pipeline`, `stages` and `cli` still come from the installed
# package wherever one is (CI installs it non-editable).
sys.path.append(str(Path(__file__).resolve().parent.parent))


def _pin_threads() -> None:
    """Every command a test runs (in this process or in a child) takes a fixed thread count
    through OMP_NUM_THREADS instead of `--threads auto`'s reading of the machine's load: that reading
    costs 0.2 s per command and picks fewer threads while another process is busy, so two runs a
    test compares byte for byte could run with different counts. The count is the machine's cores
    shared among pytest-xdist's workers (`pytest -n 2` on 2 cores: one thread each, so two workers
    never make torch's threads wait on one another), torch's default without xdist. Set before
    torch is imported, so torch's own default is that count too. tests/command_line/test_threads.py
    tests `auto` itself, without the variable; torchrun launches (harness.runs) set 1 per rank."""
    ours = os.environ.get(_PINNED_HERE) == "1"   # set by this file in pytest's main process, not by the user
    if os.environ.get("OMP_NUM_THREADS") and not ours:
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        # A worker inherits the main process's count (every core): replaced before torch starts
        # its threads. Two workers of two threads on two cores run 6x slower, not 2x (measured).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))
        if "torch" in sys.modules:  # imported before this file (a plugin): make it follow the variable
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    elif not ours:
        import torch
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        os.environ[_PINNED_HERE] = "1"


_PINNED_HERE = "DFLASH_TESTS_PINNED_THREADS"
_pin_threads()

# A test marked with harness.prerequisites.needs(...) skips where the machine lacks it, and fails
# under CI=true, where the machine must have it: the hook that reads the marks.
from harness.prerequisites import pytest_runtest_setup  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """The shared trained drafter is built by the first file handed out, while the other worker
    runs files that do not need it (harness/file_order.py)."""
    from harness.file_order import ordered
    items[:] = ordered(items, "trained_run", builder="tests/eval/test_eval.py")


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """The CLI sets torch's thread count for its process (`--threads auto`: fewer on a busy
    machine); a test that runs it in-process must not leave that count to the next test."""
    import torch
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def embedded():
    from pipeline import embedded
    return embedded


@pytest.fixture(scope="session")
def tokenizer(embedded):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(embedded.TARGET_DIR, local_files_only=True)


@pytest.fixture(scope="session")
def target(embedded):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    # use_kernels=False: transformers 5.25 would otherwise kernelize from the Hub at load (or, without
    # the `kernels` package, refuse to load), as pipeline/target_model/internals/versions.py says.
    return AutoModelForCausalLM.from_pretrained(embedded.TARGET_DIR, local_files_only=True, dtype=torch.float32,
                                                use_kernels=False).eval()


def _jsonl(path) -> list[dict]:
    """The file's rows as written (the tests' own reading, not the pipeline's parser)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="session")
def heldout_rows(embedded):
    return _jsonl(embedded.HELDOUT_DATA)


@pytest.fixture(scope="session")
def train_rows(embedded):
    return _jsonl(embedded.TRAIN_DATA)


TRAINED_STEPS = 250


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, train_rows):
    """One drafter for every test that needs a trained one and does not test training itself:
    the tiny preset, TRAINED_STEPS steps (log every 10) on a cache of the first 400 training
    conversations in 2 shards (on the thinking, tool-calling kit 150 steps gave a block tau of
    1.7 on 64 held-out prompts, 250 steps 2.6). {"run": the run directory, "cache": its cache,
    "steps": TRAINED_STEPS}. Tests must not write into it."""
    from harness.built_once import built_once
    from harness.runs import small_cache
    from stages.train.run import resolve_config, run_train

    def build(root):
        cache = small_cache(root, train_rows[:400], 2)
        cfg, preset_target = resolve_config(None, {"cache": str(cache), "out": str(root / "run"),
                                                   "max_steps": TRAINED_STEPS, "log_every": 10})
        run_train(cfg, preset_target=preset_target, warn=lambda *_: None)

    root = built_once(tmp_path_factory, "trained", build)
    cache = root / "cache"
    return {"run": root / "run", "cache": cache, "steps": TRAINED_STEPS}


@pytest.fixture(scope="session")
def twelve_rows_cache(tmp_path_factory, train_rows):
    """The first 12 training conversations and their cache in 3 shards of small batches (256
    tokens): the reference that the fault and object-store tests compare their caches with.
    {"data": the JSONL, "cache": the cache directory}. Tests must not write into either."""
    from harness.built_once import built_once
    from harness.runs import write_rows
    from pipeline.config import ExtractConfig
    from stages.extract.run import run_extract

    def build(root):
        data = write_rows(root / "convs.jsonl", train_rows[:12])
        run_extract(ExtractConfig(cache=str(root / "reference" / "cache"), data=[str(data)], num_shards=3,
                                  batch_tokens=256), None, progress=False)

    root = built_once(tmp_path_factory, "twelve", build)
    data, cache = root / "convs.jsonl", root / "reference" / "cache"
    return {"data": data, "cache": cache}
