"""One owner per concept (issue 20): the typed manifest record, its one identity comparison, and
the one target resolver. Oracles: the manifest file as written on disk, fields changed by hand,
and the resolution rule as stated in pipeline/target_model/facts.py."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from harness.caches import manifest_json
from harness.runs import small_cache
from pipeline.cache.identity import parse_identity
from pipeline.cache.manifest import read_manifest
from pipeline.errors import PipelineError
from pipeline.target_model import RecordedTarget, config_sha256, resolve_target


@pytest.fixture(scope="module")
def cache(tmp_path_factory, train_rows):
    return small_cache(tmp_path_factory.mktemp("manifest"), train_rows[:24], num_shards=2)


def edited(cache: Path, tmp_path: Path, change) -> Path:
    raw = manifest_json(cache)
    change(raw)
    out = tmp_path / "edited"
    out.mkdir(exist_ok=True)
    (out / "manifest.json").write_text(json.dumps(raw))
    return out


def test_the_record_reads_and_writes_the_manifest_exactly(cache):
    raw = manifest_json(cache)
    manifest = read_manifest(cache)
    assert manifest.to_json() == raw
    assert manifest.identity.capture.target_layer_ids == raw["config"]["capture"]["target_layer_ids"]
    assert manifest.committed() == sorted(raw["shards"])
    assert manifest.shards["shard-00001"].tokens == raw["shards"]["shard-00001"]["tokens"]
    assert manifest.identity.shard_identity() == raw["shards"]["shard-00000"]["identity"]


@pytest.mark.parametrize("change, message", [
    (lambda m: m["config"]["capture"].update(hidden_size="128"),
     "field 'config.capture.hidden_size' must be an integer, got str"),
    (lambda m: m["config"]["tokenizer"].pop("end_of_turn"), "field 'config.tokenizer.end_of_turn' is missing"),
    (lambda m: m["config"]["capture"].update(rope="x"), "field 'config.capture.rope' is not known to this version"),
    (lambda m: m["shards"]["shard-00000"].update(tokens=None), "field 'shards.shard-00000.tokens' must be an integer"),
    (lambda m: m["plan"].update(num_rows=[1]), "field 'plan.num_rows' must be an integer, got list"),
])
def test_a_malformed_field_is_refused_by_name(cache, tmp_path, change, message):
    bad = edited(cache, tmp_path, change)
    with pytest.raises(PipelineError) as e:
        read_manifest(bad)
    assert str(e.value).startswith(f"{bad / 'manifest.json'}: {message}")
    assert "\n" not in str(e.value)


def test_a_shard_field_this_version_does_not_know_is_kept(cache, tmp_path):
    bad = edited(cache, tmp_path, lambda m: m["shards"]["shard-00000"].update(note={"by": "a later tool"}))
    manifest = read_manifest(bad)
    assert manifest.to_json()["shards"]["shard-00000"]["note"] == {"by": "a later tool"}


# Fields changed by hand, each at its place in the on-disk JSON, and the dotted name the
# comparison must report for it.
CHANGES = [
    (("capture", "top_k"), 8, "capture.top_k"),
    (("tokenizer", "thinking"), "off", "tokenizer.thinking"),
    (("target", "weights", "files", "model.safetensors"), "0" * 64, "target.weights.files.model.safetensors"),
    (("capture", "storage", "options", "small_chunks_per_file"), 4, "capture.storage.options.small_chunks_per_file"),
    (("num_shards",), 3, "num_shards"),
]


@pytest.mark.parametrize("count", [0, 1, 2, len(CHANGES)])
def test_the_identity_comparison_names_exactly_the_changed_fields(cache, count):
    recorded = manifest_json(cache)["config"]
    requested = copy.deepcopy(recorded)
    for path, value, _ in CHANGES[:count]:
        node = requested
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    a, b = parse_identity(recorded), parse_identity(requested)
    found = a.differences(b.flat(), complete=True)
    assert sorted(d.field for d in found) == sorted(name for _, _, name in CHANGES[:count])
    for d in found:
        (path, value, _), = [c for c in CHANGES if c[2] == d.field]
        node = recorded
        for part in path:
            node = node[part]
        assert (d.recorded, d.other) == (node, value)
    # A partial claim compares only what it claims, with the same comparison.
    assert [d.field for d in a.differences({"capture.top_k": 8, "capture.hidden_size": recorded["capture"]["hidden_size"]})] \
        == ["capture.top_k"]


def test_extract_names_the_conflicting_field(cache, train_rows):
    """The second invocation with another top-k goes through the same comparison."""
    from pipeline.config import ExtractConfig
    from stages.extract.run import run_extract

    data = json.loads((cache / "manifest.json").read_text())["sources"]["data"]
    with pytest.raises(PipelineError, match=r"different configuration \(capture.top_k: 32 -> 8\)"):
        run_extract(ExtractConfig(cache=str(cache), data=data, num_shards=2, top_k=8), None, progress=False)


# --------------------------------------------------------------------------- which target


def test_the_option_wins(embedded, tmp_path):
    other = tmp_path / "t"
    shutil.copytree(embedded.TARGET_DIR, other)
    recorded = RecordedTarget(path=str(embedded.TARGET_DIR), config_sha256=config_sha256(embedded.TARGET_DIR), source="x")
    assert resolve_target(str(other), recorded) == other
    assert resolve_target("embedded", None) == embedded.TARGET_DIR
    with pytest.raises(PipelineError, match=f"{tmp_path / 'none'}: not a target model directory"):
        resolve_target(str(tmp_path / "none"), recorded)


def test_the_recorded_target_is_used_only_if_it_is_the_recorded_model(embedded, tmp_path):
    digest = config_sha256(embedded.TARGET_DIR)
    moved = tmp_path / "moved"
    shutil.copytree(embedded.TARGET_DIR, moved)
    assert resolve_target(None, RecordedTarget(path=str(moved), config_sha256=digest, source="m")) == moved
    # Recorded path gone, the embedded target is the recorded model (a moved install): used.
    gone = RecordedTarget(path=str(tmp_path / "gone"), config_sha256=digest, source="the cache manifest")
    assert resolve_target(None, gone) == embedded.TARGET_DIR
    # Recorded path gone and the embedded target is another model: no silent fallback.
    other = RecordedTarget(path=str(tmp_path / "gone"), config_sha256="0" * 64, source="the cache manifest")
    with pytest.raises(PipelineError) as e:
        resolve_target(None, other)
    assert str(e.value) == f"the target recorded in the cache manifest ({tmp_path / 'gone'}) is not there; pass --target DIR"
    # Recorded path present but a different model now: refused, not used.
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "note": "edited"}))
    with pytest.raises(PipelineError, match=r"is not the recorded model \(its config.json differs\); pass --target DIR"):
        resolve_target(None, RecordedTarget(path=str(moved), config_sha256=digest, source="m"))
    with pytest.raises(PipelineError, match="no target given and none recorded: pass --target DIR"):
        resolve_target(None, None)


def test_eval_does_not_fall_back_to_the_embedded_target(tmp_path):
    """A drafter export without its run record and no --target: refused (it used to run against
    the embedded target whatever the drafter was trained for)."""
    from stages.eval.options import EvalOptions
    from stages.eval.run import run_eval

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    with pytest.raises(PipelineError, match="no target given and none recorded: pass --target DIR"):
        run_eval(EvalOptions(drafter=drafter, target=None, prompts=None, max_new_tokens=4, block_size=None,
                             tree_budget=[], tree_top_k=4, limit=1))


def test_verify_and_train_compare_a_target_with_the_same_comparison(cache, embedded, tmp_path):
    """Another chat template: verify's target check and train's refusal name the same fields."""
    from pipeline.cache.reader import CacheReader
    from pipeline.target_model import load_tokenizer
    from stages.train.run import resolve_config, run_train
    from pipeline.verify.selection_checks import check_target_identity

    other = tmp_path / "other"
    shutil.copytree(embedded.TARGET_DIR, other)
    template = other / "chat_template.jinja"
    template.write_text(template.read_text() + "\n")
    check = check_target_identity(CacheReader(cache), other, load_tokenizer(other))
    assert not check.passed
    assert check.evidence["fields"] == ["tokenizer.chat_template_sha256", "tokenizer.files_sha256"]
    with pytest.raises(PipelineError, match="tokenizer files sha256: cache"):
        cfg, preset_target = resolve_config(None, {"cache": str(cache), "out": str(tmp_path / "run"), "target": str(other),
                                                   "max_steps": 1})
        run_train(cfg, preset_target=preset_target, warn=lambda *_: None)


# --------------------------------------------------------------------------- the mask id


def test_a_mask_id_that_occurs_in_the_data_is_refused(tmp_path, train_rows):
    """Extract records the reserved ids each shard contains; train refuses a mask id among them,
    and reads the input_ids of a shard that lacks the record (a cache written before it)."""
    from stages.train.run import resolve_config, run_train

    rows = train_rows[:20] + [{"input_ids": [10, 11, 499, 12, 13, 14, 15, 16], "loss_mask": [0, 0, 0, 1, 1, 1, 1, 1]}]
    cache = small_cache(tmp_path, rows, 2)
    raw = manifest_json(cache)
    assert 499 in raw["shards"]["shard-00001"]["counts"]["special_ids"]
    assert 499 not in raw["shards"]["shard-00000"]["counts"]["special_ids"]

    def train():
        cfg, preset_target = resolve_config(None, {"cache": str(cache), "out": str(tmp_path / "run"), "max_steps": 1})
        run_train(cfg, preset_target=preset_target, warn=lambda *_: None)

    message = r"mask token id 499 occurs in the cache's input_ids \(shard-00001\)"
    with pytest.raises(PipelineError, match=message):
        train()
    for record in raw["shards"].values():
        del record["counts"]["special_ids"]
    (cache / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(PipelineError, match=message):
        train()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_mask_token_may_be_an_id_and_must_be_reserved(cache, embedded):
    from pipeline.target_model import read_target_facts
    from pipeline.training.mask_token import mask_token_id

    facts = read_target_facts(embedded.TARGET_DIR)
    assert mask_token_id(499, embedded.TARGET_DIR, facts) == mask_token_id("<|MASK|>", embedded.TARGET_DIR, facts) == 499
    with pytest.raises(PipelineError, match="mask token id 20 .* is an ordinary token of the tokenizer"):
        mask_token_id(20, embedded.TARGET_DIR, facts)
    with pytest.raises(PipelineError, match="has no embedding row"):
        mask_token_id(facts.vocab_size, embedded.TARGET_DIR, facts)
