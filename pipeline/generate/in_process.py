"""The target writing answers in this process (`pipeline generate` without --server): batched
sampling with each sequence's own seed (pipeline/generate/decoding.py)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.data.loss_mask import generation_prompt, render, template_message
from pipeline.devices import dtype_name, resolve_device
from pipeline.embedded import TARGET_DIR
from pipeline.errors import PipelineError
from pipeline.generate.assistant import parse_assistant
from pipeline.generate.decoding import generate
from pipeline.generate.turns import Turn, Written
from pipeline.target_model import end_of_turn_ids, load_target, read_target_facts
from pipeline.target_model.live import LiveTarget


class InProcess:
    """The target's transformers model in this process (pipeline/generate/decoding.py)."""

    def __init__(self, target_dir: Path, tokenizer, *, device: str, dtype: str, max_new_tokens: int, temperature: float,
                 top_p: float, batch_size: int):
        device_, dtype_ = resolve_device(device, dtype)   # a bare cuda: this rank's GPU under torchrun
        self.tokenizer = tokenizer
        self.target = LiveTarget(load_target(target_dir, dtype=dtype_).to(device_), [])
        self.stop = end_of_turn_ids(tokenizer)
        self.max_new, self.temperature, self.top_p, self.batch_size = max_new_tokens, temperature, top_p, batch_size
        self.device = f"{device_} ({dtype_name(dtype_)})"
        self.identity = {"backend": "in-process", "target": _target_name(target_dir),
                         "target_config_sha256": read_target_facts(target_dir).config_sha256}
        self._supplied: dict[str, str] = {}

    def supplied(self, kwargs: dict | None) -> str:
        key = json.dumps(kwargs or {}, sort_keys=True)
        if key not in self._supplied:
            self._supplied[key] = generation_prompt(self.tokenizer, kwargs or {}).supplied
        return self._supplied[key]

    def write(self, turns: list[Turn], wheres: list[str]) -> list[Written]:
        out: list[Written] = []
        for first in range(0, len(turns), self.batch_size):
            chunk = turns[first:first + self.batch_size]
            prompts = [self.tokenizer(self._prompt(t, where), add_special_tokens=False)["input_ids"]
                       for t, where in zip(chunk, wheres[first:first + self.batch_size])]
            generated = generate(self.target, prompts, max_new=self.max_new, stop=self.stop,
                                 temperature=self.temperature, top_p=self.top_p, seeds=[t.seed for t in chunk])
            for turn, g in zip(chunk, generated):
                if not g.finished:
                    out.append(Written(None, len(g.tokens)))
                    continue
                parsed = parse_assistant(self.tokenizer.decode(g.tokens), self.supplied(turn.template_kwargs))
                out.append(Written(parsed.message, len(g.tokens), parsed.problem))
        return out


    def _prompt(self, turn: Turn, where: str) -> str:
        """The turn's prompt text. The validating pass rendered every prompt of the data; a turn
        after regenerated ones can still differ (other tool calls), so a refusal here is one line too."""
        try:
            return render(self.tokenizer, turn.messages, generation_prompt=True, tools=turn.tools,
                          template_kwargs=turn.template_kwargs)
        except Exception as e:  # noqa: BLE001 - templates raise many types
            raise PipelineError(f"{where}: the chat template cannot render the prompt for this turn "
                                f"({template_message(e)})") from None


def _target_name(target_dir: Path) -> str:
    """How generated_by names the target: `embedded`, or the directory as given. The config digest
    beside it is the identity; the name must not depend on where the tool is installed (the
    output and the resume plan would differ between installs)."""
    return "embedded" if Path(target_dir).resolve() == Path(TARGET_DIR).resolve() else str(target_dir)
