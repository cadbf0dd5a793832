"""The tool-calling demo model: the SmolLM2 demo's weights with a chat template that renders tools.

SmolLM2-135M-Instruct's own template has no tools. This one is ChatML in the Qwen 2.5 / Hermes
convention most small tool models use: the tools' JSON schemas listed in the system turn, calls
written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, results returned in
`<tool_response>` blocks of a user turn. mlx-lm recognises the template (its `json_tools` parser).
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

CHAT_TEMPLATE = (
    "{%- set system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}"
    "{%- if messages and messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% endif -%}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + ((tool.function if tool.function is defined else tool) | tojson) }}"
    "{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}"
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


def build_tools_variant(text_dir: Path, out_dir: Path) -> dict:
    """Converter for import_into_store: the text demo's files (weights hard-linked where the file
    system allows) with the tool template in tokenizer_config.json; return the entry's facts."""
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
    config["chat_template"] = CHAT_TEMPLATE
    config_path.unlink()  # a hard link: write a new file, never through the link into the text model's
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    manifest = json.loads((text_dir / "mlxq.json").read_text())
    return {"kind": "text", **{k: manifest.get(k) for k in ("quantization", "context_length", "architecture")}}
