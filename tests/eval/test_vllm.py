"""vLLM as a real engine (issue 41).

The rule `generate --server` follows when a server refuses tools under the default tool choice
(vLLM without `--enable-auto-tool-choice`) is tested against a real HTTP server on 127.0.0.1
that answers as vLLM does: cheap, in the default suite.

The rest is opt-in (DFLASH_VLLM=1): benchmarks/serving/serve_vllm.py end to end on the embedded target:
vLLM's CPU build in its own venv (about 90 s of download and 3.5 GB the first time;
DFLASH_VLLM_VENV names a venv the benchmark built, to reuse it), generation through vLLM with
its parsers on and off, and the exported drafter served as vLLM's DFlash speculative model, with
the whole vocabulary, with a draft vocabulary (`--draft-vocab`: its `d2t` and head rows), and
trained on a projected cache (`extract --project-taps`: its export's fc folded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.runs import REPO
from pipeline.errors import PipelineError
from pipeline.generate.server import Server
from pipeline.generate.turns import Turn

REFUSAL = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'  # vLLM's words
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]


class FakeVllm(ThreadingHTTPServer):
    """Lists one model; a chat completion with `tools` and a tool choice other than "none" gets
    vLLM's 400 (or `refusal` for every request, when set); anything else the text "fine"."""

    def __init__(self, refusal: str | None = None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.bodies: list[dict] = []
        self.refusal = refusal

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "target", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        refusal = self.server.refusal or (REFUSAL if body.get("tools") and body.get("tool_choice", "auto") != "none" else None)
        if refusal:
            self._send(400, {"error": {"message": refusal, "type": "BadRequestError", "code": 400}})
            return
        self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 2}})


def turn(tools=None) -> Turn:
    return Turn(messages=[{"role": "user", "content": "weather?"}], tools=tools, template_kwargs=None, seed=0)


def test_tools_refused_under_auto_are_sent_again_with_tool_choice_none_and_later_ones_at_once():
    with FakeVllm() as fake:
        server = Server(fake.url, None, max_new_tokens=8, temperature=0.0, top_p=1.0, concurrency=1)
        first = server.write([turn(TOOLS)], ["row 0 turn 0"])
        later = server.write([turn(TOOLS), turn()], ["row 1 turn 0", "row 2 turn 0"])
    assert [w.message for w in first + later] == [{"role": "assistant", "content": "fine"}] * 3
    sent = [b.get("tool_choice") for b in fake.bodies]
    assert sent == [None, "none", "none", None]       # refused once, then "none" whenever tools go out
    assert all(b["tools"] == TOOLS for b in fake.bodies[:3]) and "tools" not in fake.bodies[3]
    assert server.tool_choice_none and server.failures == 0   # a rule, not a transient error


@pytest.mark.parametrize("refusal", ["some other bad request", REFUSAL])
def test_any_other_400_and_a_second_refusal_fail_at_once(refusal):
    """Another 400 is not retried; a server that refuses tools even with "none" is asked twice, not forever."""
    with FakeVllm(refusal) as fake:
        server = Server(fake.url, None, max_new_tokens=8, temperature=0.0, top_p=1.0, concurrency=1)
        with pytest.raises(PipelineError, match=f"row 0 turn 0: the server answered 400 .*{refusal[-20:]}"):
            server.write([turn(TOOLS)], ["row 0 turn 0"])
    assert [b.get("tool_choice") for b in fake.bodies] == ([None] if refusal != REFUSAL else [None, "none"])


def test_a_refusal_without_tools_in_the_request_is_not_retried():
    with FakeVllm(REFUSAL) as fake:
        server = Server(fake.url, None, max_new_tokens=8, temperature=0.0, top_p=1.0, concurrency=1)
        with pytest.raises(PipelineError, match="400"):
            server.write([turn()], ["row 0 turn 0"])
    assert len(fake.bodies) == 1 and not server.tool_choice_none


@pytest.mark.skipif(os.environ.get("DFLASH_VLLM") != "1",
                    reason="vLLM end to end (its CPU build in a venv of its own, 3.5 GB: about 7 minutes, 4 with a built one "
                           "in DFLASH_VLLM_VENV); DFLASH_VLLM=1")
def test_vllm_serves_the_target_and_the_exported_drafter(tmp_path):
    venv = os.environ.get("DFLASH_VLLM_VENV") or str(tmp_path / "vllm-venv")
    work = tmp_path / "work"
    demo = subprocess.run([sys.executable, "cli.py", "demo", "--quick", "--json", "--out", str(tmp_path / "demo")],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert demo.returncode == 0, demo.stderr[-3000:]
    done = subprocess.run([sys.executable, "benchmarks/serving/serve_vllm.py", "--work", str(work), "--venv", venv,
                           "--rows", "12", "--max-new-tokens", "160", "--drafter", str(tmp_path / "demo" / "run" / "drafter")],
                          cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    summary = json.loads((work / "summary.json").read_text())
    assert summary["install"]["probe"] == "ok"
    # bf16: vLLM's kernels are not batch-invariant, so a turn or an output may part from vLLM's own
    # greedy at a tie of the target (judged as eval judges), never elsewhere.
    for mode in ("parsers_on", "parsers_off"):
        run = summary["generate"][mode]
        assert run["rows_written"] > 0 and run["turns_checked"] > 0, run
        assert run["turns_rendered_back"] + run["departed_at_ties"] == run["turns_checked"], run
        # vLLM re-serializes each tool as OpenAI's schema orders its keys: rows must keep that order
        # for the prompt it generated from to be the one extract renders.
        assert run["turns_prompt_equal"] == run["turns_checked"], run
    assert summary["generate"]["parsers_off"]["tool_choice_none"] is True   # vLLM refused "auto" and was asked again
    _served_as_eval_decodes(summary["speculative"])

    # A draft vocabulary (issue 58): 256 of the 512 ids, its head and d2t as vLLM reads them.
    run = tmp_path / "draft-vocab"
    trained = subprocess.run([sys.executable, "cli.py", "train", "--cache", str(tmp_path / "demo" / "cache"), "--out", str(run),
                              "--draft-vocab", "256", "--max-steps", "40", "--json"], cwd=REPO, capture_output=True, text=True,
                             timeout=1800)
    assert trained.returncode == 0, trained.stderr[-3000:]
    served = subprocess.run([sys.executable, "benchmarks/serving/serve_vllm.py", "--work", str(tmp_path / "work-dv"), "--venv", venv,
                             "--rows", "12", "--max-new-tokens", "160", "--skip", "generate", "--drafter", str(run / "drafter")],
                            cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert served.returncode == 0, (served.stdout + served.stderr)[-4000:]
    _served_as_eval_decodes(json.loads((tmp_path / "work-dv" / "summary.json").read_text())["speculative"])

    # A projected cache (issue 68): the drafter trained on 96 projected values a token, its export
    # folded into an ordinary fc on the full taps, which vLLM serves unchanged.
    projected, run = tmp_path / "projected-cache", tmp_path / "projected-run"
    extracted = subprocess.run([sys.executable, "cli.py", "extract", "--cache", str(projected), "--num-shards", "2",
                                "--project-taps", "96", "--pilot-tokens", "32768", "--json"], cwd=REPO,
                               capture_output=True, text=True, timeout=1800)
    assert extracted.returncode == 0, extracted.stderr[-3000:]
    trained = subprocess.run([sys.executable, "cli.py", "train", "--cache", str(projected), "--out", str(run),
                              "--max-steps", "150", "--json"], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "projected_rank" not in json.loads((run / "drafter" / "config.json").read_text())
    served = subprocess.run([sys.executable, "benchmarks/serving/serve_vllm.py", "--work", str(tmp_path / "work-pj"), "--venv", venv,
                             "--rows", "12", "--max-new-tokens", "160", "--skip", "generate", "--drafter", str(run / "drafter")],
                            cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert served.returncode == 0, (served.stdout + served.stderr)[-4000:]
    _served_as_eval_decodes(json.loads((tmp_path / "work-pj" / "summary.json").read_text())["speculative"])


def _served_as_eval_decodes(spec: dict) -> None:
    """vLLM serving an export: its outputs are its own greedy ones (a departure only at a tie of the
    target), drafts were accepted, and its acceptance length is eval's block tau on the same prompts
    within 5% (bf16 kernels differ, and outputs that part at a tie decode different text after)."""
    assert spec["prompts"] > 0 and spec["identical_to_greedy"] + spec["departed_at_ties"] == spec["prompts"], spec
    served = spec["acceptance_length"]["all"]
    assert served["drafts"] > 0 and served["acceptance_length"] > 1
    assert served["acceptance_length"] == pytest.approx(spec["eval"]["tau_pooled"]["all"]["tau"], rel=0.05), spec
