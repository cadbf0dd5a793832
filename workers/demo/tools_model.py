"""The tool-calling demo models: the SmolLM2 demo's weights with chat templates that render tools.

SmolLM2-135M-Instruct's own template has no tools. Two variants give it one each, in the two most common
conventions, so both of mlxq's ways of cutting calls out of an answer run on a real model:

- `smollm2-135m-tools`: ChatML in the Qwen 2.5 / Hermes convention most small tool models use: the tools'
  JSON schemas listed in the system turn, calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  results returned in `<tool_response>` blocks of a user turn. mlx-lm's `json_tools` parser.
- `smollm2-135m-mistral-tools`: Mistral's markup: the tools in `[AVAILABLE_TOOLS][...][/AVAILABLE_TOOLS]` before the
  last user message, calls written as `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` (no end marker: the call
  runs to the end of the answer), results in `[TOOL_RESULTS]...[/TOOL_RESULTS]`. mlx-lm's `mistral` parser. The
  turns keep SmolLM2's `<|im_start|>`/`<|im_end|>` tokens: in Mistral's own `[INST]...[/INST]` turns the model
  never ends its answer (it repeats itself until max_tokens), and `<|im_end|>` is its end of sequence.

The weights are not trained for tools: with `tool_choice: "auto"` the model rarely calls one; with
`"required"` or a named function the server's grammar makes it write a well-formed call, whose
arguments the model fills in.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

NAME = "smollm2-135m-tools"

_HERMES_TOOLS = (
    # The tools as the Hermes convention lists them in the system turn, from inside a string literal of the template
    # to inside another: the templates below put it in their own.
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + ((tool.function if tool.function is defined else tool) | tojson) }}"
    "{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>")

CHAT_TEMPLATE = (
    "{%- set system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}"
    "{%- if messages and messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% endif -%}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '\\n\\n" + _HERMES_TOOLS + "' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{% if message['content'] %}{{- '\\n' + message['content'] }}{% endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set tool_call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": '"
    " + (tool_call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"
)


VLM_CHAT_TEMPLATE = (
    # shapes-vlm-toy's template (workers/demo/vlm_build.py's CHAT_TEMPLATE, which it was trained with: without tools
    # this renders exactly what that one does) with the tools rendered as the Hermes template above renders them, so
    # a chat with images can call tools (forced by a grammar: the toy is not trained for them).
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' and messages[0]['content'] is string %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '" + _HERMES_TOOLS + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' and message['content'] is string %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant' }}{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for tool_call in message.tool_calls %}"
    "{% set tool_call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": '"
    " + (tool_call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

MISTRAL_NAME = "smollm2-135m-mistral-tools"

MISTRAL_CHAT_TEMPLATE = (
    "{%- set system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}"
    "{%- if messages and messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% endif -%}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
    "{%- set last = namespace(user=-1) %}"
    "{%- for message in messages %}{% if message['role'] == 'user' %}{% set last.user = loop.index0 %}{% endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'user' %}"
    "{{- '<|im_start|>user\\n' }}"
    "{%- if tools and loop.index0 == last.user %}"
    "{{- '[AVAILABLE_TOOLS][' }}"
    "{%- for tool in tools %}"
    "{{- (tool if tool.function is defined else {'type': 'function', 'function': tool}) | tojson }}"
    "{%- if not loop.last %}{{- ', ' }}{% endif %}"
    "{%- endfor %}"
    "{{- '][/AVAILABLE_TOOLS]\\n' }}"
    "{%- endif %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' }}{% if message['content'] %}{{- message['content'] }}{% endif %}"
    "{{- '[TOOL_CALLS][' }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{{- '{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' + (call.arguments | tojson) }}"
    "{%- if tool_call.id is defined %}{{- ', \"id\": ' + (tool_call.id | tojson) }}{% endif %}"
    "{{- '}' }}{% if not loop.last %}{{- ', ' }}{% endif %}"
    "{%- endfor %}"
    "{{- ']<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user\\n' }}{% endif %}"
    "{{- '[TOOL_RESULTS]' + ({'call_id': message.tool_call_id, 'content': message['content']} | tojson)"
    " + '[/TOOL_RESULTS]' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{% endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"
)

VARIANTS = {NAME: ("Hermes", CHAT_TEMPLATE), MISTRAL_NAME: ("Mistral", MISTRAL_CHAT_TEMPLATE)}
"""The tool-calling demo models by store name: whose convention their chat template follows, and the template."""


def build_tools_variant(text_dir: Path, out_dir: Path, template: str = CHAT_TEMPLATE) -> dict:
    """Converter for import_into_store (with `template` bound): the text demo's files (weights hard-linked where
    the file system allows) with the tool `template` in tokenizer_config.json; return the entry's facts."""
    for src in text_dir.iterdir():
        if not src.is_file() or src.name in ("mlxq.json", "chat_template.jinja"):
            continue
        dst = out_dir / src.name
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.unlink()  # a hard link: write a new file, never through the link into the text model's
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    manifest = json.loads((text_dir / "mlxq.json").read_text())
    return {"kind": "text", **{k: manifest.get(k) for k in ("quantization", "context_length", "architecture")}}
