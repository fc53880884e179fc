"""Chat format of the tiny target: Qwen's chat tokens and a template with the structure of Qwen3.6's.

What the template does, as Qwen3.6's does for text messages:
- `tools` open the system turn with their JSON schemas inside `<tools>` (the system prompt, if
  any, follows); the instructions after the schemas are shortened (TOOLS_INSTRUCTIONS): the
  miniature learns the call format from its data, and every token of a prompt costs training time;
- an assistant turn after the last user query renders `<think>\\n{reasoning}\\n</think>\\n\\n{content}`
  (reasoning from `reasoning_content`, or split out of the content at `</think>`); earlier turns
  render their content only, unless `preserve_thinking` is set;
- tool calls follow the content as `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>` (strings raw, other values as JSON);
- `tool` messages become `<tool_response>` blocks in one user turn per run of replies;
- the generation prompt supplies `<think>\\n` (thinking on, the default) or an empty, closed think
  block with `enable_thinking=false`.
tests/data/test_tokenizer.py renders conversations of every shape with this template and with the real
Qwen3.6 template (the instructions replaced) and compares them character for character.
"""

from __future__ import annotations

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Reserved for the DFlash drafter's block slots 1..B-1; never produced by the template or data.
MASK = "<|MASK|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END, MASK]

# Single tokens in Qwen's vocabulary too, but not special: they are text the model writes, and
# decoding keeps them (Qwen3.x marks them the same way).
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
MARKERS = [THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE]

TOOLS_INSTRUCTIONS = "\n\nTo call a function, reply with <tool_call> blocks."

CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is none or content is undefined -%}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part.text is defined -%}{{ part.text }}{%- else -%}{{ raise_exception('Unexpected item type in content.') }}{%- endif -%}
{%- endfor -%}
{%- else -%}{{ raise_exception('Unexpected content type.') }}
{%- endif -%}
{%- endmacro -%}
{%- if not messages -%}{{ raise_exception('No messages provided.') }}{%- endif -%}
{%- if tools and tools is iterable and tools is not mapping -%}
{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nTo call a function, reply with <tool_call> blocks.' -}}
{%- if messages[0].role == 'system' -%}
{%- set system = text(messages[0].content) | trim -%}
{%- if system -%}{{- '\\n\\n' + system -}}{%- endif -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\\n' + (text(messages[0].content) | trim) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- set state = namespace(last_query=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}
{%- set said = text(message.content) | trim -%}
{%- if not (said.startswith('<tool_response>') and said.endswith('</tool_response>')) -%}
{%- set state.last_query = loop.index0 -%}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if state.last_query < 0 -%}{{ raise_exception('No user query found in messages.') }}{%- endif -%}
{%- for message in messages -%}
{%- set content = text(message.content) | trim -%}
{%- if message.role == 'system' -%}
{%- if not loop.first -%}{{ raise_exception('System message must be at the beginning.') }}{%- endif -%}
{%- elif message.role == 'user' -%}
{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{%- if message.reasoning_content is string -%}
{%- set reasoning = message.reasoning_content -%}
{%- elif '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- else -%}
{%- set reasoning = '' -%}
{%- endif -%}
{%- if preserve_thinking is true or loop.index0 > state.last_query -%}
{{- '<|im_start|>assistant\\n<think>\\n' + (reasoning | trim) + '\\n</think>\\n\\n' + content -}}
{%- else -%}
{{- '<|im_start|>assistant\\n' + content -}}
{%- endif -%}
{%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping -%}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{%- if not loop.first -%}{{- '\\n' -}}{%- elif content | trim -%}{{- '\\n\\n' -}}{%- endif -%}
{{- '<tool_call>\\n<function=' + call.name + '>\\n' -}}
{%- if call.arguments is defined -%}
{%- for name, value in call.arguments | items -%}
{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' -}}
{%- endfor -%}
{%- endif -%}
{{- '</function>\\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.previtem and loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- else -%}
{{- raise_exception('Unexpected message role.') -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- else -%}
{{- '<think>\\n' -}}
{%- endif -%}
{%- endif -%}
"""


def render(messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = False,
           **template_kwargs) -> str:
    """The template rendered as transformers renders it, without a tokenizer (the tokenizer is
    trained on these renderings)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=CHAT_TEMPLATE,
                                        add_generation_prompt=add_generation_prompt, **template_kwargs)
    return rendered[0]
