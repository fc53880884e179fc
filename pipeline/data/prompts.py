"""Prompts for decoding, from the same conversation files extract reads."""

from __future__ import annotations

from pathlib import Path

from pipeline.data.conversations import iter_rows
from pipeline.data.loss_mask import render, template_message
from pipeline.errors import PipelineError


def read_prompts(path: Path, tokenizer, limit: int | None) -> list[dict]:
    """Conversations -> prompts: everything before the last assistant turn, rendered with the
    chat template's generation prompt and the row's tools and chat_template_kwargs. Rows are read
    by extract's parser (`messages` or ShareGPT `conversations`, JSONL or Parquet, tool-call
    arguments as objects), so any row extract accepts is a prompt here; one-line errors name the
    file and line."""
    prompts = []
    for row in iter_rows([Path(path)], need_answer=False):
        if row.messages is None:
            raise PipelineError(f"{row.where}: a pre-tokenized row (input_ids) has no conversation to prompt with")
        messages = row.messages[:-1] if row.messages and row.messages[-1]["role"] == "assistant" else row.messages
        if not messages:
            raise PipelineError(f"{row.where}: nothing before the assistant turn to use as a prompt")
        try:
            text = render(tokenizer, messages, generation_prompt=True, tools=row.tools, template_kwargs=row.template_kwargs)
        except Exception as e:  # noqa: BLE001 - templates raise many types
            raise PipelineError(f"{row.where}: the chat template cannot render this prompt ({template_message(e)})") from None
        prompts.append({"id": row.row_id if row.row_id is not None else row.where,
                        "ids": tokenizer(text, add_special_tokens=False)["input_ids"], "fields": row.fields or {}})
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise PipelineError(f"{path}: no prompts")
    return prompts
