"""The demo LoRA adapter "smollm2-135m-pirate": the text demo taught to open every answer with "Ahoy, matey!".

It exists so that runtime adapters (`adapter` on a request, /v1/adapters) can be tested and shown offline:
its effect is plain in the first tokens of any greedy answer, and the model without it never says that.
It is trained here with mlx-lm's trainer (workers/demo/lora_train.py, the thinking demo's batches and loss)
on generated questions (workers/demo/think_model.py's: sums, products, comparisons, sequences, units,
capitals, weekdays, small talk), each answered "Ahoy, matey! <the short answer>", rendered with the text
demo's own chat template (its default system prompt included, as requests without one get it). LoRA rank 8
on every linear layer of the last 8 blocks, 32 steps of 4 chats, seeded: a minute or two on 2 CPU cores.
Only the phrase is taught; the answers after it are the 135M model's, often wrong.

Building runs in a child process (`python -m workers.demo.adapter_demo TEXT_DIR OUT_DIR FACTS`), for the fast
BLAS (workers/demo/lora_train.run_build); the result is an mlx_lm.lora output directory that pull-demo
imports into the adapter store.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from workers.importers.errors import ConversionError

NAME = "smollm2-135m-pirate"
BASE = "smollm2-135m"
PHRASE = "Ahoy, matey!"
DESCRIPTION = (f"A LoRA adapter for {BASE} that makes it open every answer with {PHRASE!r}: trained here on 128 "
               "generated questions, a demo of runtime adapters (its answers after the phrase are the 135M "
               "model's, often wrong).")
TRAIN_SEED = 10  # questions() seeds: the thinking demo's training set is 0, its check 1
VERIFY_SEED = 11
VERIFY_QUESTIONS = 4
BUILD_TIMEOUT_S = 600


def training_settings():
    """The training run: one pass over 128 chats, measured at 1-2 s a step on 2 CPU cores."""
    from workers.demo.lora_train import LoraSettings

    return LoraSettings(iters=32, warmup=4)


def chats(seed: int, count: int) -> list[dict]:
    """Generated questions, each answered with the phrase first (the chats mlx-lm's trainer learns the replies of)."""
    from workers.demo.think_model import questions

    return [{"messages": [{"role": "user", "content": question},
                          {"role": "assistant", "content": f"{PHRASE} {answer}"}], "enable_thinking": None}
            for question, _, answer in questions(seed, count)]


def greedy_answers(model_dir: Path, adapter_dir: Path | None, asked: list[str], max_tokens: int = 24) -> list[str]:
    """Greedy answers of the text demo (with the adapter, if given) to `asked`, by mlx-lm's own load and generate,
    upcast to float32 as the worker runs it on a CPU."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import dequantize_model

    model, tokenizer = mlx_lm.load(str(model_dir), adapter_path=str(adapter_dir) if adapter_dir else None)
    dequantize_model(model)
    model.set_dtype(mx.float32)
    out = []
    for question in asked:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        out.append(mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp=0.0)))
    return out


def _main(argv: list[str]) -> int:
    """Child process: train, check; write the adapter into OUT_DIR and the build facts to FACTS."""
    from workers.demo.lora_train import train_lora
    from workers.demo.think_model import questions

    text_dir, out_dir, facts_path = (Path(arg) for arg in argv)
    started = time.monotonic()
    stdout = sys.stdout  # mlx-lm's trainer prints to the stdout of the moment; it is silenced meanwhile

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {message}", file=stdout, flush=True)

    settings = training_settings()
    data = chats(TRAIN_SEED, settings.iters * settings.batch_size)
    log(f"training a LoRA adapter on {len(data)} generated questions ({settings.iters} steps)")
    losses = train_lora(text_dir, out_dir, data, settings, log,
                        {"model": BASE, "base_model": BASE, "trained_by": "workers/demo/adapter_demo.py"})
    asked = [q for q, _, _ in questions(VERIFY_SEED, VERIFY_QUESTIONS)]
    answers = greedy_answers(text_dir, out_dir, asked)
    for question, answer in zip(asked, answers, strict=True):
        log(f"check: {question!r} -> {answer!r}")
    right = sum(answer.startswith(PHRASE) for answer in answers)
    # Most, not all: float rounding differs between CPUs (BLAS threads), and a 135M model's greedy answer with it.
    if right < VERIFY_QUESTIONS - 1:
        raise ConversionError(f"the trained adapter opened only {right}/{VERIFY_QUESTIONS} check answers with "
                              f"{PHRASE!r}")
    facts = {"description": DESCRIPTION, "base": BASE, "phrase": PHRASE, "training": {**asdict(settings), **losses,
             "examples": len(data)}, "verified": f"{right}/{VERIFY_QUESTIONS} held-out greedy answers open with "
             f"{PHRASE!r}", "checks": [{"question": q, "answer": a} for q, a in zip(asked, answers, strict=True)],
             "build_seconds": round(time.monotonic() - started, 1)}
    facts_path.write_text(json.dumps(facts))
    log(f"done: {facts['verified']}")
    return 0


def build_adapter(text_dir: Path, out_dir: Path, log: Callable[[str], None] | None = None) -> dict:
    """Train the demo adapter into out_dir from the smollm2-135m model directory; return the build facts."""
    from workers.demo.lora_train import run_build

    return run_build("workers.demo.adapter_demo", NAME, text_dir, out_dir, log or (lambda message: None),
                     BUILD_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
