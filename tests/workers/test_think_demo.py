"""The thinking demo model smollm2-135m-think (built by `mlxq models pull-demo`), through mlx-lm itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.model_files import chat_template_of
from jobs.settings import load_settings
from jobs.store import store_entry
from workers.demo.think_model import ADAPTER_DIR, CHAT_TEMPLATE, NAME, Settings, examples, questions

HELD_OUT_SEED = 1000  # the training questions come from seed 0 and the build's own check from seed 1
ASKED = [question for question, _, _ in questions(HELD_OUT_SEED, 3)]  # a sum, a product, a comparison
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def think_dir(models_dir) -> Path:
    """The store entry, as pull-demo builds it."""
    path = Path(models_dir) / NAME
    if not (path / "mlxq.json").is_file():
        pytest.fail(f"{NAME} missing in {models_dir}: run `mlxq models pull-demo` first")
    return path


@pytest.fixture(scope="module")
def stored_model(think_dir):
    """(model, tokenizer) from mlx_lm.load, as stored (quantized, the fused layers in float16)."""
    import mlx_lm

    return mlx_lm.load(str(think_dir))


@pytest.fixture(scope="module")
def float32_model(think_dir):
    """The weights loaded again and upcast to float32, as the worker runs them on a CPU (~10x faster here)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.utils import dequantize_model

    model, tokenizer = mlx_lm.load(str(think_dir))
    dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, tokenizer


def ask(model, tokenizer, question: str, thinking: bool, **template) -> str:
    """mlx-lm's own prompt rendering (the model's template, told enable_thinking) and greedy generation."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           enable_thinking=thinking, **template)
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, sampler=make_sampler(temp=0.0))


def assert_thinks_then_answers(text: str) -> None:
    """`<think>`, some working, `</think>`, then an answer without markers."""
    assert text.startswith("<think>"), text
    reasoning, end, answer = text.partition("</think>")
    assert end, f"the block never closes: {text!r}"
    assert reasoning.removeprefix("<think>").strip(), text
    assert answer.strip() and "<think>" not in answer, text


def test_the_questions_asked_here_were_not_trained_on():
    trained = {example["messages"][0]["content"] for example in examples(Settings())}
    assert len(set(ASKED)) == 3 and not trained & set(ASKED), ASKED


@pytest.mark.parametrize("question", ASKED)
def test_it_thinks_then_answers(float32_model, question):
    assert_thinks_then_answers(ask(*float32_model, question, thinking=True))


@pytest.mark.parametrize("question", ASKED)
def test_with_thinking_off_it_answers_at_once(float32_model, question):
    text = ask(*float32_model, question, thinking=False)
    assert text.strip() and "<think>" not in text, text


def tool(name: str, description: str) -> dict:
    """A function with one parameter, a city, as a client would send it."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


TOOLS = {"get_weather": tool("get_weather", "Get the current weather in a city."),
         "get_time": tool("get_time", "Get the local time in a city.")}


@pytest.mark.parametrize(("question", "called"), [("What's the weather like in Lyon?", "get_weather"),
                                                  ("What time is it in Sydney?", "get_time")])
def test_with_a_tool_it_thinks_then_calls_it(float32_model, question, called):
    """Greedy, with no grammar holding it: a block that says why, then a Hermes-style call (the cities are not
    among the training chats'). Offered two tools, it sometimes calls the wrong one: not asserted here."""
    text = ask(*float32_model, question, thinking=True, tools=[TOOLS[called]])
    assert_thinks_then_answers(text)
    call = text.partition("</think>")[2].strip()
    assert call.startswith("<tool_call>\n") and call.endswith("\n</tool_call>"), text
    payload = json.loads(call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert payload["name"] == called and set(payload["arguments"]) == {"city"}, text


def test_the_stored_weights_think_too(stored_model):
    assert_thinks_then_answers(ask(*stored_model, ASKED[0], thinking=True))


def test_the_adapter_on_the_text_demo_thinks_too(models_dir, think_dir):
    """The adapter kept beside the fused weights is the one they were made with: mounted on smollm2-135m by
    mlx-lm (its loader never reads the subdirectory by itself), it writes the same format."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(Path(models_dir) / "smollm2-135m"), adapter_path=str(think_dir / ADAPTER_DIR))
    assert_thinks_then_answers(ask(model, tokenizer, ASKED[0], thinking=True, chat_template=CHAT_TEMPLATE))


def test_the_template_renders_thinking_as_qwen3_does(stored_model):
    tokenizer = stored_model[1]
    asked = [{"role": "user", "content": "What is 2 + 2?"}]
    render = tokenizer.apply_chat_template
    assert render(asked, add_generation_prompt=True, enable_thinking=True, tokenize=False).endswith(
        "<|im_start|>assistant\n")
    assert render(asked, add_generation_prompt=True, enable_thinking=False, tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    history = asked + [{"role": "assistant", "content": "<think>\n2 and 2 make 4.\n</think>\n\n4."},
                       {"role": "user", "content": "And 3 + 3?"}]
    rendered = render(history, add_generation_prompt=True, tokenize=False)
    assert "2 and 2 make 4" not in rendered and "<|im_start|>assistant\n4.<|im_end|>" in rendered, rendered


def test_the_entry_reasons_calls_tools_and_says_what_it_is(models_dir, think_dir):
    template = chat_template_of(think_dir)
    assert template == CHAT_TEMPLATE
    assert all(marker in template for marker in ("enable_thinking", "<tool_call>", "tool_call.name"))
    info = store_entry(load_settings({"models_dir": models_dir}), NAME)
    assert {"tools", "reasoning"} <= set(info.capabilities), info.capabilities
    manifest = json.loads((think_dir / "mlxq.json").read_text())
    assert manifest["toy"] is True and "not a reasoner" in manifest["description"]
    assert (think_dir / ADAPTER_DIR / "adapters.safetensors").is_file()
    assert not list(think_dir.glob("adapters*")), "mlx-lm's loader would take an adapter at the top level"
