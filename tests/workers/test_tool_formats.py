"""jobs/model_files.py decides a model's tool-call format without mlx-lm (the web tier lists "tools" from it and
picks its grammar); the worker's tokenizer gets its parser from mlx-lm. They must agree: here the table is
checked against mlx-lm's own `_infer_tool_parser` on small synthetic templates, and against mlx-lm's tokenizer
loader on model directories (tokenizer_config.json's `tool_parser_type`, named templates, chat_template.jinja)."""

from __future__ import annotations

import importlib
import itertools
import json
import pkgutil
import shutil
from pathlib import Path
from types import SimpleNamespace

import mlx_lm.tool_parsers
import pytest
from mlx_lm.tokenizer_utils import _infer_tool_parser
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import MODEL_REMAPPING

from jobs.model_files import (
    MODEL_TOOL_PARSERS,
    TOOL_PARSERS,
    TOOL_TEMPLATE_RULES,
    TOOL_VOCAB_RULES,
    tool_format_in,
    tool_format_of,
)
from workers.demo.tools_model import CHAT_TEMPLATE, MISTRAL_CHAT_TEMPLATE

# One template per way a rule can match, plus near misses (half of a pair, the words without the markup).
MARKUPS = [" ".join(markers) for _, alternatives in TOOL_TEMPLATE_RULES for markers in alternatives]
NEAR_MISSES = ["", "{{ tools }}", "<|tool_call>", "<tool_call|>", '<function name="', '<param name="', "<tool_call>",
               "tool_call.name", "<tool_call><function=", "[TOOL_CALL]", "<|tool_call_end|>", "<minimax:tool_call"]


def mlx_lm_parser(template, vocab=()) -> str | None:
    """mlx-lm's inference on a tokenizer with this template and vocabulary."""
    return _infer_tool_parser(SimpleNamespace(chat_template=template, get_vocab=lambda: dict.fromkeys(vocab, 0)))


def test_the_parsers_are_mlx_lms():
    modules = {m.name for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__)}
    assert TOOL_PARSERS == modules
    assert {name for name, _ in TOOL_TEMPLATE_RULES + TOOL_VOCAB_RULES} <= TOOL_PARSERS


@pytest.mark.parametrize("template", MARKUPS + NEAR_MISSES + [CHAT_TEMPLATE, MISTRAL_CHAT_TEMPLATE])
def test_one_template_gets_mlx_lms_parser(template):
    assert tool_format_of(template) == mlx_lm_parser(template)


def test_two_markups_in_one_template_resolve_in_mlx_lms_order():
    for first, second in itertools.permutations(MARKUPS + NEAR_MISSES[2:], 2):
        template = f"{{% if tools %}}{first}{{% else %}}{second}{{% endif %}}"
        assert tool_format_of(template) == mlx_lm_parser(template), template


def test_the_demo_templates_are_json_tools_and_mistral():
    assert mlx_lm_parser(CHAT_TEMPLATE) == "json_tools"
    assert mlx_lm_parser(MISTRAL_CHAT_TEMPLATE) == "mistral"


# --- whole model directories, against mlx-lm's tokenizer loader -----------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_files(models_dir):
    """The demo text model's tokenizer files (a real vocabulary without tool tokens)."""
    source = models_dir / "smollm2-135m"
    if not source.is_dir():
        pytest.skip("demo model missing: `mlxq models pull-demo`")
    return source


def model_dir(tmp_path, source, name: str, config_changes: dict, files: dict | None = None, added=()):
    """A tokenizer directory: the demo's files, its tokenizer_config.json changed, more `files` written, and
    `added` tokens added to tokenizer.json."""
    out = tmp_path / name
    out.mkdir()
    for file in ("config.json", "special_tokens_map.json"):
        shutil.copy(source / file, out / file)
    if added:
        tokenizer = json.loads((source / "tokenizer.json").read_text())
        size = len(tokenizer["model"]["vocab"])
        tokenizer["added_tokens"] += [{"id": size + i, "content": content, "single_word": False, "lstrip": False,
                                       "rstrip": False, "normalized": False, "special": True}
                                      for i, content in enumerate(added)]
        (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    else:
        (out / "tokenizer.json").symlink_to(source / "tokenizer.json")
    config = {**json.loads((source / "tokenizer_config.json").read_text()), **config_changes}
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v != "-"}))
    for relative, text in (files or {}).items():
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        (out / relative).write_text(text)
    return out


NAMED = [{"name": "default", "template": "{{ messages }}"}, {"name": "tool_use", "template": "[TOOL_CALLS] {{ tools }}"}]
PAIR = ("<|tool_call_start|>", "<|tool_call_end|>")
CASES = {  # name: (tokenizer_config.json changes ("-": left out), files to write, tokens added, the parser)
    "no-tools": ({}, None, (), None),
    "mistral-in-config": ({"chat_template": "[TOOL_CALLS]{{ tools }}"}, None, (), "mistral"),
    "parser-named": ({"tool_parser_type": "qwen3_coder"}, None, (), "qwen3_coder"),
    "parser-named-over-template": ({"tool_parser_type": "glm47", "chat_template": "[TOOL_CALLS]"}, None, (), "glm47"),
    "parser-null": ({"tool_parser_type": None, "chat_template": "[TOOL_CALLS]"}, None, (), "mistral"),
    "named-templates": ({"chat_template": NAMED}, None, (), None),
    "jinja-over-config": ({"chat_template": "[TOOL_CALLS]"}, {"chat_template.jinja": "<arg_key>"}, (), "glm47"),
    "jinja-without-config": ({"chat_template": "-"}, {"chat_template.jinja": CHAT_TEMPLATE}, (), "json_tools"),
    "additional-templates": ({"chat_template": "-"}, {"chat_template.jinja": "[TOOL_CALLS]",
                                                      "additional_chat_templates/tool_use.jinja": "<arg_key>"}, (), None),
    "vocab-pythonic": ({}, None, PAIR, "pythonic"),
    "vocab-half": ({}, None, PAIR[:1], None),
    "vocab-in-config": ({"added_tokens_decoder": {
        str(49152 + i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                         "special": True} for i, token in enumerate(PAIR)}}, None, (), "pythonic"),
    "vocab-kimi-k3": ({}, None, ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"), "kimi_k3"),
    "template-before-vocab": ({"chat_template": "[TOOL_CALLS]"}, None, PAIR, "mistral"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_model_directory_gets_the_parser_mlx_lms_loader_gives_it(tmp_path, tokenizer_files, name):
    changes, files, added, parser = CASES[name]
    path = model_dir(tmp_path, tokenizer_files, name, changes, files, added)
    loaded = load_tokenizer(path)
    given = loaded._tokenizer.init_kwargs.get("tool_parser_type") if loaded.has_tool_calling else None
    assert given == parser  # what mlx-lm does (the case is what it says it is)
    assert tool_format_in(path) == parser


def model_type_defaults() -> dict:
    """model_type -> the parser its mlx-lm module's TOKENIZER_DEFAULTS names (only those modules are imported)."""
    import mlx_lm.models

    found = {}
    for module in pkgutil.iter_modules(mlx_lm.models.__path__):
        source = Path(mlx_lm.models.__path__[0], module.name + ".py")
        if source.is_file() and "TOKENIZER_DEFAULTS" in source.read_text():
            defaults = importlib.import_module(f"mlx_lm.models.{module.name}").TOKENIZER_DEFAULTS
            if "tool_parser_type" in defaults:
                found[module.name] = defaults["tool_parser_type"]
    return found


def test_model_type_defaults_are_mlx_lms(tmp_path):
    assert MODEL_TOOL_PARSERS == model_type_defaults()
    assert not set(MODEL_TOOL_PARSERS) & set(MODEL_REMAPPING)  # no other model_type reaches these modules
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert tool_format_in(tmp_path, {"model_type": "muse_spark"}) == "muse_spark"
    assert tool_format_in(tmp_path, {"model_type": "llama"}) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tool_parser_type": None}))
    assert tool_format_in(tmp_path, {"model_type": "muse_spark"}) is None  # null in the config wins, as in mlx-lm
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tool_parser_type": "no_such_parser"}))
    assert tool_format_in(tmp_path, {"model_type": "llama"}) is None
    assert tool_format_in(None) is None


def test_the_toy_vlms_template_renders_tools_and_without_them_what_it_was_trained_with():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from workers.demo.tools_model import VLM_CHAT_TEMPLATE
    from workers.demo.vlm_build import CHAT_TEMPLATE as TRAINED

    env = ImmutableSandboxedEnvironment()
    env.filters["tojson"] = json.dumps
    mine, trained = env.from_string(VLM_CHAT_TEMPLATE), env.from_string(TRAINED)
    chats = [[{"role": "user", "content": "Hi"}],
             [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this image?"}]},
              {"role": "assistant", "content": "A red circle."}, {"role": "user", "content": "And now?"}]]
    for messages, generation in itertools.product(chats, (True, False)):
        assert mine.render(messages=messages, add_generation_prompt=generation) == \
            trained.render(messages=messages, add_generation_prompt=generation)
    tool = {"type": "function", "function": {"name": "name_shape", "parameters": {"type": "object"}}}
    rendered = mine.render(messages=chats[1], add_generation_prompt=True, tools=[tool])
    assert rendered.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "name_shape"' in rendered
    assert rendered.count("Be brief.") == 1 and "<image>What is in this image?" in rendered
    assert tool_format_of(VLM_CHAT_TEMPLATE) == _infer_tool_parser(SimpleNamespace(
        chat_template=VLM_CHAT_TEMPLATE, get_vocab=dict)) == "json_tools"
