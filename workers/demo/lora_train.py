"""LoRA training for the demo builds: mlx-lm's trainer on generated chats, in a child process.

The thinking demo (workers/demo/think_model.py) trained the first adapter here; its batches, its loss on
the completion only and its learning-rate schedule are reused as they are (its module is the build key of a
cached model: editing it would retrain that demo in every fresh store). What this module adds is what
another build needs besides: training on any list of chats with any LoRA settings, and running a build in a
child process with the fast BLAS (`run_build`). The adapter demo (workers/demo/adapter_demo.py) uses both.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from workers.demo.think_model import completion_loss, mixed_batches, schedule, tokenized
from workers.importers.errors import ConversionError


@dataclass(frozen=True)
class LoraSettings:
    """What a training run does: steps, batches, learning rate (peak after `warmup` steps, then a cosine decay
    to a tenth) and the LoRA layers (`lora_layers` last blocks, every linear layer, of this rank and scale)."""

    iters: int
    batch_size: int = 4
    learning_rate: float = 5e-4
    warmup: int = 5
    lora_layers: int = 8
    rank: int = 8
    scale: float = 20.0
    max_seq_length: int = 320


def train_lora(model_dir: Path, adapter_dir: Path, chats: list[dict], settings: LoraSettings,
               log: Callable[[str], None], about: dict | None = None) -> dict:
    """Train a LoRA adapter on `chats` (each {"messages": [..., the assistant's reply], "enable_thinking"}: the
    reply is the completion learned) with mlx-lm's trainer, on the dequantized float32 model, seeded; save it in
    adapter_dir as mlx_lm.lora does (adapters.safetensors, adapter_config.json with `about` added); return the
    losses."""
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
    config = {"fine_tune_type": "lora", "num_layers": settings.lora_layers, "lora_parameters": lora,
              **(about or {}), "training": asdict(settings)}
    (adapter_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    losses = []

    class Report(TrainingCallback):
        def on_train_loss_report(self, info: dict) -> None:
            losses.append(round(info["train_loss"], 4))
            log(f"step {info['iteration']}/{settings.iters}: loss {info['train_loss']:.3f}")

    data = [tokenized(chat, tokenizer) for chat in chats]
    window = max(len(ids) - start for ids, start in data)
    args = TrainingArgs(batch_size=settings.batch_size, iters=settings.iters, steps_per_report=4,
                        steps_per_save=settings.iters + 1, max_seq_length=settings.max_seq_length,
                        adapter_file=str(adapter_dir / "adapters.safetensors"))
    with contextlib.redirect_stdout(io.StringIO()):  # its progress UI: the callback logs the losses
        train(model, optim.Adam(learning_rate=schedule(settings)), data, args=args,
              loss=partial(completion_loss, window=window), iterate_batches=mixed_batches,
              training_callback=Report())
    return {"first_loss": losses[0], "last_loss": losses[-1], "losses": losses}


def run_build(module: str, name: str, text_dir: Path, out_dir: Path, log: Callable[[str], None],
              timeout_s: float = 900) -> dict:
    """Run `python -m module TEXT_DIR OUT_DIR FACTS` with the fast BLAS preloaded (training needs it: see
    workers/demo/vlm_build.py), passing its output lines to `log`; return the facts it wrote (ConversionError with
    its stderr's tail if it fails or runs past `timeout_s`)."""
    from workers.platform import choose_blas

    env = choose_blas().env(os.environ)
    root = Path(__file__).resolve().parents[2]  # the repository root, so `-m workers...` resolves
    with tempfile.TemporaryDirectory(prefix=f"mlxq-demo-{name}-") as scratch:
        facts_path, errors_path = Path(scratch) / "facts.json", Path(scratch) / "stderr.txt"
        command = [sys.executable, "-m", module, str(text_dir), str(out_dir), str(facts_path)]
        with open(errors_path, "w+") as errors:
            process = subprocess.Popen(command, env=env, cwd=root, stdout=subprocess.PIPE, stderr=errors, text=True)
            timer = threading.Timer(timeout_s, process.kill)  # a hung child must not hang pull-demo
            timer.start()
            try:
                for line in process.stdout:
                    log(f"{name}: {line.rstrip()}")
                code = process.wait()
            except BaseException:
                process.kill()
                process.wait()
                raise
            finally:
                timer.cancel()
            errors.seek(0)
            tail = errors.read()[-2000:]
        if code != 0 or not facts_path.is_file():
            raise ConversionError(f"building {name} failed (exit {code}): {tail.strip()}")
        return json.loads(facts_path.read_text())
