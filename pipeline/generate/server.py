"""The server backend of `pipeline generate`: an OpenAI-compatible chat-completions endpoint
(vLLM, SGLang, `transformers serve`), called with the standard library only.

Requests go out concurrently up to a bound; a connection error, a timeout, 429 or 5xx is retried
with exponential backoff (`RETRIES` times), anything else fails at once. When every retry fails,
the error names the row and the turn and what the server said: the shard in flight is not
written, so a re-run resumes there. A response's `reasoning_content` (or `reasoning`) and
`tool_calls` are kept as fields; a server that returns the raw text (no reasoning or tool parser
for this model) has it split here the way the chat template renders it (assistant.py).
Model/tokenizer mismatch: the server must list `--model` in /v1/models, and, when the target's
tokenizer is known, the prompt token count the server reports must equal ours for the first
turn.
A vLLM server started without `--enable-auto-tool-choice` refuses a request with `tools` (400):
that request is sent again with `"tool_choice": "none"` (the template still renders the tools;
the raw text is split here), and every later one with tools goes out that way at once.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from pipeline.errors import PipelineError
from pipeline.generate.assistant import parse_assistant
from pipeline.generate.turns import Written

RETRIES, BACKOFF_S, TIMEOUT_S = 4, 0.5, 600
TRANSIENT = {408, 429, 500, 502, 503, 504}
AUTO_TOOL_CHOICE = "--enable-auto-tool-choice"   # in vLLM's 400 for tools without a tool-call parser


class ServerError(Exception):
    pass


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _get(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


class Server:
    def __init__(self, url: str, model: str | None, *, max_new_tokens: int, temperature: float, top_p: float,
                 concurrency: int, tokenizer=None, timeout: float = TIMEOUT_S):
        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.max_new, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.concurrency, self.tokenizer, self.timeout = concurrency, tokenizer, timeout
        self.model = self._check_model(model)
        self.identity = {"backend": "server", "url": url, "model": self.model}
        self.device = f"server {url}"
        self.failures = 0          # transient errors retried
        self.tool_choice_none = False   # the server refused tools under the default tool_choice "auto"
        self._checked_tokens = tokenizer is None

    def _check_model(self, model: str | None) -> str:
        try:
            listed = [m.get("id") for m in _get(self.base + "/models", 30).get("data", [])]
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise PipelineError(f"--server {self.base}: cannot list models ({_reason(e)})") from None
        if model is None:
            if len(listed) != 1:
                raise PipelineError(f"--server {self.base} serves {listed}: pass --model NAME")
            return listed[0]
        if model not in listed:
            raise PipelineError(f"--server {self.base} does not serve {model!r} (it serves {listed})")
        return model

    def _request(self, turn, where: str) -> dict:
        body = {"model": self.model, "messages": openai_messages(turn.messages), "max_tokens": self.max_new,
                "temperature": self.temperature, "top_p": self.top_p, "seed": turn.seed}
        if turn.tools:
            body["tools"] = turn.tools
            if self.tool_choice_none:
                body["tool_choice"] = "none"
        if turn.template_kwargs:
            body["chat_template_kwargs"] = turn.template_kwargs
        delay = BACKOFF_S
        for attempt in range(RETRIES + 1):
            try:
                return _post(self.base + "/chat/completions", body, self.timeout)
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode("utf-8", "replace")
                if e.code == 400 and turn.tools and "tool_choice" not in body and AUTO_TOOL_CHOICE in detail:
                    self.tool_choice_none = True
                    return self._request(turn, where)   # once: now with "tool_choice": "none"
                if e.code not in TRANSIENT or attempt == RETRIES:
                    raise ServerError(f"{where}: the server answered {e.code} ({detail.strip()})") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                if attempt == RETRIES:
                    raise ServerError(f"{where}: no answer from {self.base} after {RETRIES + 1} tries "
                                      f"({_reason(e)})") from None
            self.failures += 1
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    def write(self, turns, wheres: list[str]):
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            futures = [pool.submit(self._request, t, w) for t, w in zip(turns, wheres)]
            try:
                responses = [f.result() for f in futures]
            except ServerError as e:
                for f in futures:
                    f.cancel()
                raise PipelineError(str(e)) from None
        out = []
        for turn, where, response in zip(turns, wheres, responses):
            try:
                choice = response["choices"][0]
                message, finish = choice["message"], choice.get("finish_reason")
                tokens = int((response.get("usage") or {}).get("completion_tokens") or 0)
            except (KeyError, IndexError, TypeError, ValueError):
                raise PipelineError(f"{where}: not a chat completion: {json.dumps(response)[:200]}") from None
            if not self._checked_tokens:
                self._check_prompt_tokens(turn, response, where)
            if finish == "length":
                out.append(Written(None, tokens))
                continue
            out.append(self._message(message, tokens))
        return out

    def _message(self, message: dict, tokens: int):
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        calls = message.get("tool_calls")
        content = message.get("content") or ""
        if reasoning is None and not calls:
            parsed = parse_assistant(content)     # the server returned the raw text
            return Written(parsed.message, tokens, parsed.problem)
        out = {"role": "assistant", "content": content}
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if calls:
            out["tool_calls"] = [_tool_call(c) for c in calls]
        return Written(out, tokens)

    def _check_prompt_tokens(self, turn, response: dict, where: str) -> None:
        from pipeline.data.loss_mask import render

        reported = (response.get("usage") or {}).get("prompt_tokens")
        ours = len(self.tokenizer(render(self.tokenizer, turn.messages, generation_prompt=True, tools=turn.tools,
                                         template_kwargs=turn.template_kwargs), add_special_tokens=False)["input_ids"])
        if reported is not None and int(reported) != ours:
            raise PipelineError(f"{where}: the server counts {reported} prompt tokens where the target's tokenizer and "
                                f"chat template give {ours}: {self.model!r} is not served with this target's "
                                "tokenizer/template")
        self._checked_tokens = True


def openai_messages(messages: list[dict]) -> list[dict]:
    """The conversation as the OpenAI API takes it: tool-call arguments as a JSON string, every
    call with an `id` and every tool reply with the `tool_call_id` of the call it answers (vLLM
    refuses a request without them; datasets seldom keep them, and chat templates do not render
    them). Ids the data has are kept; a missing one is made from the message's position, and the
    k-th reply after an assistant turn answers its k-th call."""
    out, pending = [], []
    for i, message in enumerate(messages):
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = []
            for k, call in enumerate(message["tool_calls"]):
                function = dict(call.get("function") or {})
                if not isinstance(function.get("arguments"), str):
                    function["arguments"] = json.dumps(function.get("arguments") or {})
                calls.append({**call, "id": call.get("id") or f"call_{i}_{k}", "type": call.get("type", "function"),
                              "function": function})
            pending = [c["id"] for c in calls]
            out.append({**message, "tool_calls": calls})
        elif message.get("role") == "tool":
            answered = pending.pop(0) if pending else None
            out.append({**message, "tool_call_id": message.get("tool_call_id") or answered or f"call_{i}"})
        else:
            pending = []
            out.append(message)
    return out


def _tool_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {"type": "function", "function": function}


def _reason(e: Exception) -> str:
    return str(getattr(e, "reason", None) or e) or type(e).__name__
