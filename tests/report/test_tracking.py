"""`pipeline train --report-to tensorboard,wandb,mlflow,trackio`: one real training run reports to
all four trackers (the real libraries, offline, writing their real files), and each tracker's data
is read back with that tracker's own reader and compared with train_log.jsonl. The run is killed
(SIGKILL, mid-checkpoint) half way and resumed, as long runs are: it must continue the same four
tracker runs, and what they hold must still equal the finished run's log."""

import glob
import json
import math
import os
import struct

import pytest
from harness.prerequisites import importable
from harness.runs import cli

importable("tensorboard", "the test extra installs the trackers")

STEPS, LOG_EVERY = 40, 2  # long enough for the live verdicts to run (a clean run: none fire)
CHECKPOINT_EVERY = 10
# Killed while writing the step-20 checkpoint: the run resumes from step 10, so steps 11-20 were
# already sent to the trackers once and are logged again.
KILL_AT = "checkpoint.written@2"
DESIGN_KEYS = ("epoch", "loss", "ce", "accuracy", "top4_acc", "top8_acc", "avg_streak", "ddtree_streak4", "ddtree_streak8",
               "lr", "grad_norm", "noise_std", "tok_per_sec", "elapsed_s")


def tracker_env(root):
    """Every tracker's files under root: nothing goes to the home directory or a network."""
    env = {"TRACKIO_DIR": str(root / "trackio"), "WANDB_DIR": str(root), "WANDB_CONFIG_DIR": str(root / "wandb-config"),
           "WANDB_CACHE_DIR": str(root / "wandb-cache"), "WANDB_DATA_DIR": str(root / "wandb-data"),
           "MLFLOW_TRACKING_URI": None, "WANDB_MODE": None, "WANDB_API_KEY": None, "HOME": str(root / "home")}
    return env


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, sixty_four_rows_cache):
    root = tmp_path_factory.mktemp("tracked")
    env = {k: v for k, v in tracker_env(root).items()}
    args = ("train", "--cache", str(sixty_four_rows_cache), "--out", str(root / "run"), "--max-steps", str(STEPS), "--log-every",
            str(LOG_EVERY), "--checkpoint-every", str(CHECKPOINT_EVERY), "--report-to", "tensorboard,wandb,mlflow,trackio",
            "--json")
    killed = cli(*args, env={**env, "PIPELINE_FAILPOINT": KILL_AT})
    assert killed.returncode == -9, killed.stderr
    first_ids = json.loads((root / "run" / "trackers.json").read_text())
    result = cli(*args, env=env)
    assert result.returncode == 0, result.stderr
    log = [json.loads(x) for x in (root / "run" / "train_log.jsonl").read_text().splitlines()]
    config = json.loads((root / "run" / "run.json").read_text())["config"]
    return {"root": root, "run": root / "run", "summary": json.loads(result.stdout), "log": log, "stderr": result.stderr,
            "lr": config["optimizer"]["lr"], "first_ids": first_ids}


def expected(log):
    """{key: {step: value}} as the trackers should hold them: the DESIGN 4 keys under train/, the
    per-slot accuracy as train/pos_acc/slot_K."""
    out = {}
    for record in log:
        for key in DESIGN_KEYS:
            out.setdefault(f"train/{key}", {})[record["step"]] = float(record[key])
        for k, value in enumerate(record["pos_acc"], 1):
            out.setdefault(f"train/pos_acc/slot_{k}", {})[record["step"]] = float(value)
    return out


def assert_same(found: dict, want: dict, rel: float):
    for key, series in want.items():
        assert key in found, f"{key} missing; has {sorted(found)[:8]}..."
        assert sorted(found[key]) == sorted(series), (key, sorted(found[key]), sorted(series))
        for step, value in series.items():
            assert math.isclose(found[key][step], value, rel_tol=rel, abs_tol=1e-7), (key, step, found[key][step], value)


def test_json_output_stays_parseable_and_lists_the_trackers(tracked):
    assert tracked["summary"]["report_to"] == ["tensorboard", "wandb", "mlflow", "trackio"]
    assert tracked["summary"]["verdicts"] == []  # a clean run
    assert [r["step"] for r in tracked["log"]] == [1, *range(LOG_EVERY, STEPS + 1, LOG_EVERY)]
    ids = json.loads((tracked["run"] / "trackers.json").read_text())
    assert set(ids) == {"wandb", "mlflow", "trackio"}
    assert ids == tracked["first_ids"]  # the resumed run continued the killed run's tracker runs
    assert tracked["summary"]["resumed_from_step"] == CHECKPOINT_EVERY


def test_tensorboard_event_files_hold_every_logged_value(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tracked["run"] / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    found = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert_same(found, expected(tracked["log"]), rel=1e-6)  # TensorBoard stores float32
    # The stretch logged before the kill and again after the resume is there once (purged on resume).
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == [r["step"] for r in tracked["log"]], steps
    assert "run/parameters/text_summary" in acc.Tags()["tensors"]
    table = acc.Tensors("run/parameters/text_summary")[0].tensor_proto.string_val[0].decode()
    assert f"| config.optimizer.lr | {tracked['lr']} |" in table and "cache.capture.target_layer_ids" in table


def test_mlflow_store_holds_every_logged_value_the_config_and_the_drafter(tracked):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tracked['run'] / 'mlflow.db'}")
    run_id = json.loads((tracked["run"] / "trackers.json").read_text())["mlflow"]
    run = client.get_run(run_id)
    want = expected(tracked["log"])
    found = {key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in want}
    assert_same(found, want, rel=1e-12)
    params = run.data.params
    assert params["config.optimizer.lr"] == str(tracked["lr"]) and params["config.tracking.report_to"] == '["tensorboard", "wandb", "mlflow", "trackio"]'
    assert json.loads(params["cache.capture.target_layer_ids"]) == [1, 3, 5]
    assert run.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(run_id, "drafter")}
    assert {"drafter/config.json", "drafter/model.safetensors"} <= artifacts


def read_wandb_records(path):
    """The records of a W&B transaction log (.wandb), parsed with W&B's own protobuf schema: a
    7-byte header (':W&B', 0xBEE1, version 0), then LevelDB-log framing (32 KiB blocks; chunks
    FULL/FIRST/MIDDLE/LAST with a crc32, a length and a type)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, buffer, records = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        buffer += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buffer)
            records.append(record)
            buffer = b""
    return records


def test_wandb_offline_run_holds_every_logged_value_the_config_and_the_drafter(tracked):
    # W&B offline writes one directory per process of the run (killed, then resumed), same run id.
    files = sorted(glob.glob(str(tracked["run"] / "wandb" / "offline-run-*" / "run-*.wandb")), key=os.path.getmtime)
    run_id = json.loads((tracked["run"] / "trackers.json").read_text())["wandb"]
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files), files
    records = [r for f in files for r in read_wandb_records(f)]  # later writes override
    found, config, artifacts = {}, {}, []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if key.startswith("train/"):
                    found.setdefault(key, {})[step] = float(json.loads(item.value_json))
        elif kind == "run":
            config.update({(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "artifact":
            artifacts.append((record.artifact.type, [m.path for m in record.artifact.manifest.contents]))
    # W&B writes its transaction log from a helper process that dies with a SIGKILLed run before
    # flushing (measured here: the killed process's log held only its header), so what was logged
    # before the checkpoint resumed from may be missing; everything from there on must be there,
    # and whatever is there must equal the log.
    want = expected(tracked["log"])
    for key, series in want.items():
        assert key in found, key
        assert set(found[key]) <= set(series), (key, sorted(set(found[key]) - set(series)))
        assert {s for s in series if s > CHECKPOINT_EVERY} <= set(found[key]), (key, sorted(found[key]))
        assert_same({key: found[key]}, {key: {s: series[s] for s in found[key]}}, rel=1e-12)
    assert config["config.optimizer.lr"] == tracked["lr"] and json.loads(config["cache.capture.target_layer_ids"]) == [1, 3, 5]
    assert artifacts and artifacts[0][0] == "model" and {"config.json", "model.safetensors"} <= set(artifacts[0][1])


def test_trackio_store_holds_every_logged_value_and_the_config(tracked):
    os.environ["TRACKIO_DIR"] = str(tracked["root"] / "trackio")  # read where the run wrote
    from trackio.sqlite_storage import SQLiteStorage

    name = json.loads((tracked["run"] / "trackers.json").read_text())["trackio"]
    logs = SQLiteStorage.get_logs("dflash", name)
    found = {}
    for row in logs:
        for key, value in row.items():
            if key.startswith("train/"):
                found.setdefault(key, {})[row["step"]] = float(value)
    assert_same(found, expected(tracked["log"]), rel=1e-12)
    config = SQLiteStorage.get_run_config("dflash", name)
    assert config["config.optimizer.lr"] == tracked["lr"]


def test_a_tracker_that_is_not_installed_is_one_line_naming_the_extra(tmp_path):
    import subprocess
    import sys

    from harness.runs import REPO

    code = "import sys; sys.modules['trackio'] = None; sys.argv = ['pipeline'] + sys.argv[1:]; from cli import app; app()"
    result = subprocess.run([sys.executable, "-c", code, "train", "--cache", str(tmp_path / "none"), "--out",
                             str(tmp_path / "run"), "--report-to", "trackio"], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}, timeout=300)
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert 'pip install "dflash-pipeline[trackio]"' in lines[0]
    assert not (tmp_path / "run").exists()

    unknown = cli("train", "--cache", str(tmp_path / "none"), "--report-to", "tensorboard,comet")
    lines = [x for x in unknown.stderr.splitlines() if x.strip()]
    assert unknown.returncode == 1 and len(lines) == 1 and "'comet'" in lines[0] and "tensorboard, wandb" in lines[0]


def test_a_tracker_that_fails_mid_run_is_one_warning_and_is_dropped(tmp_path):
    """MLflow's store deleted under a running tracker: its next write fails inside MLflow; the run
    gets one warning naming the tracker, and the other trackers go on (training is not stopped)."""
    from pipeline.tracking import open_trackers

    warnings = []
    trackers = open_trackers(["mlflow", "tensorboard"], run_dir=tmp_path, run_name="r", params={"config": {"lr": 1}},
                             start_step=0, warn=warnings.append)
    trackers.log({"step": 1, "loss": 2.0})
    (tmp_path / "mlflow.db").unlink()
    trackers.log({"step": 2, "loss": 1.5})
    trackers.log({"step": 3, "loss": 1.0})
    trackers.close()
    # MLflow writes buffered batches in the background: the failure shows at its next write.
    assert len(warnings) == 1 and warnings[0].startswith("mlflow: ") and " failed (" in warnings[0], warnings
    assert [b.name for b in trackers.backends] == ["tensorboard"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]  # the other tracker kept everything
