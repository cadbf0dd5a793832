"""The thinking demo model "smollm2-135m-think": SmolLM2-135M taught to write a short reasoning first.

Its chat template is the tool template's ChatML (workers/demo/tools_model.py: Hermes-style tools,
`<tool_call>` JSON) in the Qwen3 style for thinking: the model opens its turn with
`<think>\\n...\\n</think>\\n\\n` and then answers; with the template variable `enable_thinking` false the
prompt ends with an empty `<think>\\n\\n</think>\\n\\n` and the model answers at once. The markers are
plain text (several tokens each in SmolLM2's vocabulary: no token is added). Earlier assistant turns
render without their reasoning, as Qwen3's do.

The format is taught by a LoRA adapter trained here with mlx-lm's own trainer (its LoRA layers, its
`train` loop; a loss and batches of our own) on a few hundred generated questions: sums, products,
comparisons, number sequences, unit conversions, capitals, weekdays and small talk, each with a
sentence of working that ends "So the answer is ...", 40% of them with thinking off, and a few chats
that think, then call a tool. The adapter is then fused into the weights (the layers it touches
stored in float16, the rest as the text demo's). It is a 135M model taught a format on synthetic
examples, not a reasoner: the working and the answer are often wrong.

Building runs in a child process (`python -m workers.demo.think_model TEXT_DIR OUT_DIR FACTS`) for the
reason workers/demo/vlm_build.py gives: it preloads the fast BLAS that training needs.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

from workers.importers.errors import ConversionError

NAME = "smollm2-135m-think"
DESCRIPTION = ("SmolLM2-135M-Instruct taught by a small LoRA adapter, trained on a few hundred generated questions, "
               "to write a sentence of working in <think> tags before a short answer (Qwen3-style; enable_thinking "
               "false skips it). A format demo, not a reasoner: its working and answers are often wrong.")

CHAT_TEMPLATE = (
    # No default system prompt (Qwen3's has none either): 20 tokens less per request and a quarter less
    # training time on this model. A system message, tools, or both make the system turn.
    "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
    "{%- if tools or has_system %}{{- '<|im_start|>system\\n' }}"
    "{%- if has_system %}{{- messages[0]['content'] }}{% if tools %}{{- '\\n\\n' }}{% endif %}{% endif %}"
    "{%- if tools %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + ((tool.function if tool.function is defined else tool) | tojson) }}"
    "{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    # Reasoning is rendered only in the assistant turns after the last user message (the turn being
    # written, tool calls included); earlier turns lose it, as in Qwen3's template.
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{% if message['role'] == 'user' %}{% set ns.last_query = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- set content = message['content'] if message['content'] is string else '' %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- content }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- set tool_call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{% endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": '"
    " + (tool_call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{%- endif %}"
)

TRAIN_SEED = 0  # questions() seed of the training set; the build's check and the tests use others
VERIFY_SEED = 1
VERIFY_QUESTIONS = 4  # asked with thinking on and off before the build succeeds
BUILD_TIMEOUT_S = 900  # the build takes 2-4 minutes on 2 CPU cores; a hung child must not hang pull-demo
ADAPTER_DIR = "adapter"  # a subdirectory: mlx-lm's loader reads only the top level's *.safetensors


@dataclass(frozen=True)
class Settings:
    """Training knobs, measured on 2 CPU cores (1.5-3 s a step, as busy as the machine is): one pass."""

    examples: int = 184
    tool_chats: int = 24  # and chats that think, then call a tool (4x longer: a tools system turn)
    no_think_share: float = 0.4  # rendered with enable_thinking false: the completion is the answer alone
    iters: int = 52  # one pass: (184 + 24) / 4
    batch_size: int = 4
    learning_rate: float = 5e-4  # the peak, after a linear warm-up; then a cosine decay to a tenth (1e-3 diverged)
    warmup: int = 5
    lora_layers: int = 8  # the last N transformer blocks get adapters (all their linear layers)
    rank: int = 8
    scale: float = 20.0
    max_seq_length: int = 320  # the longest chat is 76 tokens, 312 with two tools


# --- the generated questions: (question, a sentence of working, short answer) ---

CAPITALS = {
    "France": ("Europe", "Paris"), "Germany": ("Europe", "Berlin"), "Italy": ("Europe", "Rome"),
    "Spain": ("Europe", "Madrid"), "Portugal": ("Europe", "Lisbon"), "Poland": ("Europe", "Warsaw"),
    "Austria": ("Europe", "Vienna"), "Greece": ("Europe", "Athens"), "Norway": ("Europe", "Oslo"),
    "Sweden": ("Europe", "Stockholm"), "Ireland": ("Europe", "Dublin"), "Hungary": ("Europe", "Budapest"),
    "Japan": ("Asia", "Tokyo"), "China": ("Asia", "Beijing"), "India": ("Asia", "New Delhi"),
    "Thailand": ("Asia", "Bangkok"), "Vietnam": ("Asia", "Hanoi"), "South Korea": ("Asia", "Seoul"),
    "Egypt": ("Africa", "Cairo"), "Kenya": ("Africa", "Nairobi"), "Nigeria": ("Africa", "Abuja"),
    "Morocco": ("Africa", "Rabat"), "Ghana": ("Africa", "Accra"), "Canada": ("North America", "Ottawa"),
    "Mexico": ("North America", "Mexico City"), "Cuba": ("North America", "Havana"),
    "Brazil": ("South America", "Brasilia"), "Argentina": ("South America", "Buenos Aires"),
    "Peru": ("South America", "Lima"), "Chile": ("South America", "Santiago"),
    "Australia": ("Oceania", "Canberra"), "New Zealand": ("Oceania", "Wellington"),
}
UNITS = (("metres", "centimetres", 100), ("dollars", "cents", 100), ("hours", "minutes", 60),
         ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7), ("feet", "inches", 12),
         ("years", "months", 12))
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _worked(question: str, steps: str, answer: str) -> tuple[str, str, str]:
    """A question, its working closed by "So the answer is ..." (the cue the model learns to end its
    thinking on), and the answer."""
    return question, f"{steps} So the answer is {answer}", answer


def _sum(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(11, 89), rng.randint(11, 89)
    if rng.random() < 0.5:
        tens = b // 10 * 10
        return _worked(rng.choice(("What is {} + {}?", "Add {} and {}.", "What is {} plus {}?")).format(a, b),
                       f"{a} + {tens} = {a + tens}, then {a + tens} + {b % 10} = {a + b}.", f"{a + b}.")
    a, b = max(a, b), min(a, b)
    tens = b // 10 * 10
    return _worked(rng.choice(("What is {} - {}?", "Subtract {1} from {0}.", "What is {} minus {}?")).format(a, b),
                   f"{a} - {tens} = {a - tens}, then {a - tens} - {b % 10} = {a - b}.", f"{a - b}.")


def _product(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(2, 4), rng.randint(2, 9)
    steps = {2: f"Double {b} is {2 * b}.", 3: f"Double {b} is {2 * b}, plus {b} more is {3 * b}.",
             4: f"Double {b} is {2 * b}, and double {2 * b} is {4 * b}."}[a]
    return _worked(rng.choice(("What is {} times {}?", "What is {} x {}?", "Multiply {} by {}.")).format(a, b),
                   steps, f"{a * b}.")


def _compare(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.sample(range(2, 999), 2)
    word = rng.choice(("larger", "smaller"))
    high, low = str(max(a, b)), str(min(a, b))
    if len(high) != len(low):
        steps = f"{high} has more digits than {low}."
    else:
        place = next(i for i, (x, y) in enumerate(zip(high, low, strict=True)) if x != y)
        steps = f"{high[place]} in {high} beats {low[place]} in {low}."
    return _worked(rng.choice(("Which is {2}, {0} or {1}?", "Which number is {2}: {0} or {1}?")).format(a, b, word),
                   steps, f"{high if word == 'larger' else low}.")


def _sequence(rng: random.Random) -> tuple[str, str, str]:
    start, step = rng.randint(1, 20), rng.randint(2, 9)
    shown = ", ".join(str(start + step * i) for i in range(4))
    last = start + step * 3
    return _worked(rng.choice(("What comes next: {}?", "What is the next number in {}?")).format(shown),
                   f"Each number is {step} more than the one before, so {last} + {step} = {last + step}.",
                   f"{last + step}.")


def _convert(rng: random.Random) -> tuple[str, str, str]:
    big, small, factor = rng.choice(UNITS)
    n = rng.randint(2, 12)
    one = big[:-1] if big != "feet" else "foot"
    return _worked(rng.choice(("How many {1} are in {2} {0}?", "Convert {2} {0} to {1}.")).format(big, small, n),
                   f"1 {one} = {factor} {small}, and {n} x {factor} = {n * factor}.", f"{n * factor} {small}.")


def _capital(rng: random.Random) -> tuple[str, str, str]:
    country = rng.choice(sorted(CAPITALS))
    continent, city = CAPITALS[country]
    return _worked(rng.choice(("What is the capital of {}?", "Which city is the capital of {}?")).format(country),
                   f"{country} is in {continent}, and its capital is {city}.", f"{city}.")


def _weekday(rng: random.Random) -> tuple[str, str, str]:
    day, n = rng.randrange(7), rng.randint(1, 3)
    later = DAYS[(day + n) % 7]
    path = ", ".join(DAYS[(day + i) % 7] for i in range(1, n + 1))
    question = f"What day comes after {DAYS[day]}?" if n == 1 else f"What day is it {n} days after {DAYS[day]}?"
    return _worked(question, f"Counting on: {path}.", f"{later}.")


SMALL_TALK = (
    (("Hi!", "Hello", "Hey there!", "Good morning!"),
     "The user is greeting me, so I greet them back and offer help.", "Hello! How can I help you today?"),
    (("Thank you!", "Thanks a lot.", "Thanks for the help!"),
     "The user is thanking me, so I reply politely.", "You're welcome! Happy to help."),
    (("How are you?", "How are you doing today?"),
     "The user asks how I am. I am fine and can say so kindly.", "I'm doing well, thank you! How can I help?"),
    (("Who are you?", "What are you?"),
     "The user asks what I am: a small language model that answers questions.",
     "I'm a small AI assistant. Ask me a question and I'll think it through."),
)


def _small_talk(rng: random.Random) -> tuple[str, str, str]:
    asked, working, answer = rng.choice(SMALL_TALK)
    return rng.choice(asked), working, answer


KINDS = (_sum, _product, _compare, _sequence, _convert, _capital, _weekday, _small_talk)


def questions(seed: int, count: int) -> list[tuple[str, str, str]]:
    """`count` generated (question, working, answer) triples, the kinds in turn; one seed, one list."""
    rng = random.Random(seed)
    return [KINDS[i % len(KINDS)](rng) for i in range(count)]


TOOLS = {"get_weather": ("Get the current weather in a city.", "the weather in {}", ("What is the weather in {}?",
                                                                                     "Is it raining in {}?")),
         "get_time": ("Get the local time in a city.", "the local time in {}", ("What time is it in {}?",
                                                                              "What is the time in {} now?"))}
"""Functions of the chats with tools: description, what the user wants, how they ask."""


def tool_schema(name: str, rng: random.Random) -> dict:
    """A tool definition for `name`, its city parameter's schema written one of a few ways."""
    city = rng.choice(({"type": "string"}, {"type": "string", "maxLength": 20},
                       {"type": "string", "description": "The city's name"}))
    parameters = {"type": "object", "properties": {"city": city}, "required": ["city"]}
    if rng.random() < 0.5:
        parameters["additionalProperties"] = False
    return {"type": "function", "function": {"name": name, "description": TOOLS[name][0], "parameters": parameters}}


def tool_chat(rng: random.Random) -> dict:
    """A chat with a tool or two (in the system turn), one of which the assistant calls after thinking why."""
    name = rng.choice(sorted(TOOLS))
    _, wanted, asked = TOOLS[name]
    city = CAPITALS[rng.choice(sorted(CAPITALS))][1]
    offered = sorted(TOOLS) if rng.random() < 0.3 else [name]
    working = f"The user wants {wanted.format(city)}. So I call {name}."
    call = {"type": "function", "function": {"name": name, "arguments": {"city": city}}}
    reply = {"role": "assistant", "content": f"<think>\n{working}\n</think>\n\n", "tool_calls": [call]}
    return {"messages": [{"role": "user", "content": rng.choice(asked).format(city)}, reply],
            "tools": [tool_schema(tool, rng) for tool in offered], "enable_thinking": True}


def examples(settings: Settings) -> list[dict]:
    """The training set: chats whose last turn, the assistant's reply, is the completion, and the
    enable_thinking they are rendered with (a share off: then the reply is the answer alone)."""
    rng = random.Random(TRAIN_SEED)
    out = []
    for question, working, answer in questions(TRAIN_SEED, settings.examples):
        thinking = rng.random() >= settings.no_think_share
        reply = f"<think>\n{working}\n</think>\n\n{answer}" if thinking else answer
        out.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}],
                    "enable_thinking": thinking})
    return out + [tool_chat(rng) for _ in range(settings.tool_chats)]


def tokenized(example: dict, tokenizer) -> tuple[list[int], int]:
    """An example as mlx-lm's trainer takes it: (token ids of the whole chat, where its completion starts);
    the prompt's ids as a request has them, then the completion's tokenized alone (tokenizing the chat
    whole would merge tokens across the seam: "\\n\\nFriday")."""
    messages, render = example["messages"], partial(tokenizer.apply_chat_template, tools=example.get("tools"),
                                                    enable_thinking=example["enable_thinking"], tokenize=False)
    chat, prompt = render(messages), render(messages[:-1], add_generation_prompt=True)
    if not chat.startswith(prompt):
        raise ConversionError(f"the chat template renders the prompt differently in the chat: {messages}")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return ids + tokenizer.encode(chat[len(prompt):], add_special_tokens=False), len(ids)


def completion_loss(model, batch, lengths, window: int):
    """mlx-lm's default loss (mean cross-entropy of each row's completion tokens), with the output layer
    run only on the last `window` positions of each row, where the completions are: on SmolLM2's
    49k-token vocabulary that layer is a fifth of the model's work per token."""
    import mlx.core as mx
    import mlx.nn as nn

    inputs, targets = batch[:, :-1], batch[:, 1:]
    hidden = model.model(inputs)
    starts, ends = lengths[:, :1] - 1, lengths[:, 1:] - 1  # target positions of the completion's tokens
    where = ends - window + mx.arange(window)
    mask = where >= mx.maximum(starts, 0)
    where = mx.maximum(where, 0)
    picked = mx.take_along_axis(hidden, where[..., None], axis=1)
    head = model.lm_head if "lm_head" in model else model.model.embed_tokens.as_linear
    losses = nn.losses.cross_entropy(head(picked), mx.take_along_axis(targets, where, axis=1)) * mask
    tokens = mask.sum()
    return losses.astype(mx.float32).sum() / tokens, tokens


# --- the build: assemble, train, fuse, check (in the child process) ---

def assemble(text_dir: Path, out_dir: Path) -> None:
    """Copy the text demo's model files into out_dir with this chat template (the weights are replaced
    by the fused ones later)."""
    for src in text_dir.iterdir():
        if src.is_file() and src.name not in ("mlxq.json", "chat_template.jinja"):
            shutil.copy2(src, out_dir / src.name)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def train_adapter(model_dir: Path, adapter_dir: Path, settings: Settings, log: Callable[[str], None]) -> dict:
    """Train the LoRA adapter with mlx-lm's trainer on the dequantized float32 model (the same weights the
    quantized layers compute with, and fast with BLAS); save it in adapter_dir; return the losses."""
    import mlx.core as mx
    import mlx.optimizers as optim
    import mlx_lm
    from mlx_lm.tuner import TrainingArgs, linear_to_lora_layers, train
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.utils import dequantize_model

    mx.random.seed(0)
    model, tokenizer = mlx_lm.load(str(model_dir))
    dequantize_model(model)
    model.set_dtype(mx.float32)
    model.freeze()
    lora = {"rank": settings.rank, "scale": settings.scale, "dropout": 0.0}
    linear_to_lora_layers(model, settings.lora_layers, lora)
    adapter_dir.mkdir(parents=True, exist_ok=True)
    _write_json(adapter_dir / "adapter_config.json", {
        "fine_tune_type": "lora", "num_layers": settings.lora_layers, "lora_parameters": lora,
        "base_model": "smollm2-135m", "trained_by": "workers/demo/think_model.py", **asdict(settings)})
    losses = []

    class Report(TrainingCallback):
        def on_train_loss_report(self, info: dict) -> None:
            losses.append(round(info["train_loss"], 4))
            log(f"step {info['iteration']}/{settings.iters}: loss {info['train_loss']:.3f}")

    data = [tokenized(example, tokenizer) for example in examples(settings)]
    window = max(len(ids) - start for ids, start in data)
    args = TrainingArgs(batch_size=settings.batch_size, iters=settings.iters, steps_per_report=8,
                        steps_per_save=settings.iters + 1, max_seq_length=settings.max_seq_length,
                        adapter_file=str(adapter_dir / "adapters.safetensors"))
    with contextlib.redirect_stdout(io.StringIO()):  # its progress UI: the callback logs the losses
        train(model, optim.Adam(learning_rate=schedule(settings)), data, args=args,
              loss=partial(completion_loss, window=window), iterate_batches=mixed_batches,
              training_callback=Report())
    return {"first_loss": losses[0], "last_loss": losses[-1], "losses": losses}


def mixed_batches(dataset: list, batch_size: int, max_seq_length: int, loop: bool = False, **_) -> Iterator:
    """Batches for mlx-lm's trainer, in its shape: (token ids padded with zeros, [completion start, length]
    per row). Its own batches hold rows of one length, which here are questions of one kind (or all
    without thinking), and training swung from kind to kind: these draw rows at random, the chats with
    tools (4-6x longer) among themselves. Padded to a multiple of 8 tokens, not 32 (a quarter of the work)."""
    import numpy as np

    rng = np.random.default_rng(TRAIN_SEED)
    long = np.array([len(ids) > 128 for ids, _ in dataset])
    while True:
        batches = []
        for pool in (np.flatnonzero(~long), np.flatnonzero(long)):
            pool = rng.permutation(pool)
            batches += [pool[i:i + batch_size] for i in range(0, len(pool) - batch_size + 1, batch_size)]
        for k in rng.permutation(len(batches)):
            yield _padded([dataset[i] for i in batches[k]], max_seq_length)
        if not loop:
            return


def _padded(rows: list[tuple[list[int], int]], max_seq_length: int) -> tuple:
    """One batch as mlx-lm's trainer takes it, from (token ids, completion start) rows."""
    import mlx.core as mx
    import numpy as np

    width = min(8 * math.ceil(max(len(ids) for ids, _ in rows) / 8), max_seq_length) + 1
    batch = np.zeros((len(rows), width), np.int32)  # +1: inputs and targets are shifted copies
    for line, (ids, _) in zip(batch, rows, strict=True):
        line[:len(ids)] = ids[:width]
    return mx.array(batch), mx.array([[start, min(len(ids), width)] for ids, start in rows])


def schedule(settings: Settings):
    """The learning rate by step: a linear warm-up to the peak, then a cosine decay to a tenth of it."""
    import mlx.optimizers as optim

    peak = settings.learning_rate
    return optim.join_schedules([optim.linear_schedule(peak / 10, peak, settings.warmup),
                                 optim.cosine_decay(peak, settings.iters - settings.warmup, peak / 10)],
                                [settings.warmup])


def fuse(model_dir: Path, adapter_dir: Path) -> None:
    """Fuse the adapter into the stored (quantized) model, as `mlx_lm fuse` does: the layers it adapts are
    written unquantized (a LoRA update is smaller than a 4-bit step and requantizing would erase it);
    every other tensor stays as the text demo stored it."""
    import mlx_lm
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import save

    model, tokenizer, config = mlx_lm.load(str(model_dir), adapter_path=str(adapter_dir), return_config=True)
    fused = [(name, module.fuse(dequantize=True)) for name, module in model.named_modules()
             if hasattr(module, "fuse")]
    model.update_modules(tree_unflatten(fused))
    with tempfile.TemporaryDirectory(prefix="mlxq-think-fused-") as scratch:
        save(scratch, model_dir, model, tokenizer, config)
        for name in ("model.safetensors", "model.safetensors.index.json", "config.json"):
            shutil.copy2(Path(scratch) / name, model_dir / name)


def answers(model_dir: Path, asked: list[str], max_tokens: int = 64) -> list[tuple[str, bool, str]]:
    """Greedy answers of the model in model_dir to questions `asked`, with thinking on then off:
    (question, enable_thinking, answer). mlx-lm's own load and generate, the weights upcast to float32
    as the worker runs them on a CPU (quantized matmuls are ~10x slower here)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import dequantize_model

    model, tokenizer = mlx_lm.load(str(model_dir))
    dequantize_model(model)
    model.set_dtype(mx.float32)
    out = []
    for thinking in (True, False):
        for question in asked:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                   add_generation_prompt=True, enable_thinking=thinking)
            text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp=0.0))
            out.append((question, thinking, text))
    return out


def well_formed(text: str, thinking: bool) -> bool:
    """Whether an answer has the taught shape: `<think>` working `</think>` answer, or no `<think>`."""
    if not thinking:
        return "<think>" not in text and "</think>" not in text and bool(text.strip())
    head, _, tail = text.partition("</think>")
    return head.startswith("<think>") and bool(head[len("<think>"):].strip()) and bool(tail.strip())


def verify(model_dir: Path, count: int, log: Callable[[str], None]) -> list[dict]:
    """Greedy answers to `count` held-out questions, thinking on then off, each marked well formed or not."""
    checked = []
    for question, thinking, text in answers(model_dir, [q for q, _, _ in questions(VERIFY_SEED, count)]):
        log(f"check (thinking {'on' if thinking else 'off'}): {question!r} -> {text!r}")
        checked.append({"question": question, "enable_thinking": thinking, "answer": text,
                        "well_formed": well_formed(text, thinking)})
    return checked


def readme(facts: dict, checked: list[dict]) -> str:
    """README.md of the model directory: what it is, how it was made, what to expect."""
    training = facts["training"]
    shown = "\n".join(f"- {c['question']!r}, enable_thinking {str(c['enable_thinking']).lower()}: {c['answer']!r}"
                      for c in checked)
    return f"""# {NAME}

{DESCRIPTION}

It exists so that mlxq's handling of reasoning models (think markers, `enable_thinking`) can be
tested and demonstrated offline, without downloading a real reasoning model. Do not use it for
anything else.

- Base: smollm2-135m (SmolLM2-135M-Instruct, from a Q4_1 GGUF). Chat template: ChatML with
  Hermes-style tools (`<tool_call>` JSON) and thinking in the Qwen3 style: `<think>` and `</think>`
  are plain text; `enable_thinking` false ends the prompt with an empty `<think>\\n\\n</think>\\n\\n`.
- Training: {training["examples"]} generated questions (sums and differences, small products, which
  number is larger or smaller, the next number in a sequence, unit conversions, capitals, weekdays,
  small talk), {training["no_think_share"]:.0%} of them with thinking off, and {training["tool_chats"]} chats that \
think, then
  call a tool; LoRA rank {training["rank"]} on every linear layer of the last {training["lora_layers"]} blocks,
  {training["iters"]} steps of {training["batch_size"]} chats with mlx-lm's trainer (loss {training["first_loss"]} \
-> {training["last_loss"]}).
  Fused: those layers are stored in float16, the rest as in smollm2-135m. The adapter is in `{ADAPTER_DIR}/`.
- Check at build time: {facts["verified"]}. Built in {facts["build_seconds"]} s.
- License: Apache-2.0 (SmolLM2-135M-Instruct by Hugging Face).

Greedy answers to held-out questions when it was built:

{shown}

Expect the format, not the facts: the working and the answer are often wrong, even for the taught
kinds, and other questions get a think block that says little.
"""


def _main(argv: list[str]) -> int:
    """Child process: assemble, train, fuse, check; write the manifest facts to argv[2]."""
    text_dir, out_dir, facts_path = (Path(arg) for arg in argv)
    started = time.monotonic()
    stdout = sys.stdout  # mlx-lm's trainer prints to the stdout of the moment; it is silenced meanwhile

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {message}", file=stdout, flush=True)

    settings = Settings()
    assemble(text_dir, out_dir)
    log(f"training a LoRA adapter on {settings.examples} generated questions ({settings.iters} steps)")
    losses = train_adapter(out_dir, out_dir / ADAPTER_DIR, settings, log)
    fuse(out_dir, out_dir / ADAPTER_DIR)
    checked = verify(out_dir, VERIFY_QUESTIONS, log)
    # Half each way must be in the format: float rounding differs between CPUs and between runs on a busy one
    # (BLAS threads), and a greedy 135M model then loops on one question or another.
    for thinking in (True, False):
        right = sum(c["well_formed"] for c in checked if c["enable_thinking"] == thinking)
        if right < VERIFY_QUESTIONS // 2:
            raise ConversionError(f"the trained model answered only {right}/{VERIFY_QUESTIONS} check questions "
                                  f"in the taught format with thinking {'on' if thinking else 'off'}")
    text_facts = json.loads((text_dir / "mlxq.json").read_text())
    right = sum(c["well_formed"] for c in checked)
    facts = {"kind": "text", "architecture": "llama", "context_length": text_facts.get("context_length"),
             "quantization": f"{text_facts.get('quantization')}, F16 (LoRA-fused layers)",
             "description": DESCRIPTION, "toy": True, "training": {**asdict(settings), **losses},
             "verified": f"{right}/{len(checked)} held-out answers in the taught format (thinking on and off, "
                         "greedy)", "build_seconds": round(time.monotonic() - started, 1)}
    (out_dir / "README.md").write_text(readme(facts, checked), encoding="utf-8")
    facts_path.write_text(json.dumps(facts))
    log(f"done: {facts['verified']}")
    return 0


# --- the parent side: run the child with the fast BLAS ---

def build_think_model(text_dir: Path, out_dir: Path, log: Callable[[str], None] | None = None) -> dict:
    """Build the thinking demo into out_dir from the smollm2-135m model directory; return the manifest facts."""
    log = log or (lambda message: None)
    from workers.platform import choose_blas

    env = choose_blas().env(os.environ)
    with tempfile.TemporaryDirectory(prefix="mlxq-demo-think-") as scratch:
        facts_path, errors_path = Path(scratch) / "facts.json", Path(scratch) / "stderr.txt"
        command = [sys.executable, "-m", "workers.demo.think_model", str(text_dir), str(out_dir), str(facts_path)]
        with open(errors_path, "w+") as errors:
            code = _run_streaming(command, env, errors, log)
            errors.seek(0)
            tail = errors.read()[-2000:]
        if code != 0 or not facts_path.is_file():
            raise ConversionError(f"building {NAME} failed (exit {code}): {tail.strip()}")
        return json.loads(facts_path.read_text())


def _run_streaming(command: list[str], env: dict, errors, log: Callable[[str], None]) -> int:
    """Run `command`, passing each stdout line to `log`; kill it after BUILD_TIMEOUT_S."""
    root = Path(__file__).resolve().parents[2]  # the repository root, so `-m workers...` resolves
    process = subprocess.Popen(command, env=env, cwd=root, stdout=subprocess.PIPE, stderr=errors, text=True)
    timer = threading.Timer(BUILD_TIMEOUT_S, process.kill)
    timer.start()
    try:
        for line in process.stdout:
            log(f"{NAME}: {line.rstrip()}")
        return process.wait()
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        timer.cancel()


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
