"""Vision benchmark, side by side in one run: mlxq vs mlx-vlm called directly vs mlx_vlm.server.

Measures (1) the time of an image request (one image as a data URL, a short answer) as a caller
sees it, and (2) decode tokens/s of a longer answer about the image, through each path. The
contestants are up at once and measured in interleaved blocks (as bench_text.py does), so a
machine whose speed drifts moves everyone's figures alike.

    python bench/bench_vision.py --model ~/.cache/mlxq/models/shapes-vlm-toy --image picture.png

Prints a JSON report (and writes it to --out). Start-up of each server is excluded.
"""

from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_text import (  # noqa: E402
    HTTPServer,
    interleaved,
    reexec_with_worker_blas,
    start_mlxq,
    summary,
)
from bench.common import Proc, decode_rate, free_port, start_redis, wait_http, write_report  # noqa: E402

QUESTION = "What is in this image?"
LONG_QUESTION = "Write a long story about this image."  # the toy VLM answers "Describe..." in 5 tokens
WARMUP = 2


def same_weights_everywhere(model_dir: Path) -> Path:
    """The model directory all three contestants load: the worker's platform policy applied once.

    On a Linux CPU with fast BLAS the worker runs small models dequantized to float32; mlx-vlm would
    run the stored quantized weights, so direct and mlx_vlm.server get a float32 copy too.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from workers.backends.vision import load
    from workers.models import weight_stats
    from workers.platform import detect

    if not detect().use_float32(weight_stats(model_dir).float32_bytes):
        return model_dir
    model, _ = load(model_dir, float32=True)
    out = Path(tempfile.mkdtemp(prefix="mlxq-bench-vlm-f32-"))
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            shutil.copy(path, out / path.name)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    return out


class Direct:
    """mlx-vlm called in this process, the way its README shows: the baseline."""

    name = "direct"

    def __init__(self, model_dir: Path, image: Path):
        import mlx_vlm

        self.model, self.processor = mlx_vlm.load(str(model_dir))
        self.image = str(image)

    def _stream(self, question: str, max_tokens: int):
        import mlx_vlm
        from mlx_vlm.prompt_utils import apply_chat_template

        prompt = apply_chat_template(self.processor, self.model.config, question, num_images=1)
        return mlx_vlm.stream_generate(self.model, self.processor, prompt, image=[self.image],
                                       max_tokens=max_tokens, temperature=0.0)

    def request(self, max_tokens: int) -> float:
        """Seconds for a whole short answer about the image (prompt, image, generation)."""
        t0 = time.perf_counter()
        for _ in self._stream(QUESTION, max_tokens):
            pass
        return time.perf_counter() - t0

    def decode(self, max_tokens: int) -> float:
        """Decode tokens/s, first to last token (wall clock)."""
        stamps = [time.perf_counter() for _ in self._stream(LONG_QUESTION, max_tokens)]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def close(self) -> None:
        """Nothing to stop."""


class DirectElsewhere:
    """The same baseline in a process of its own (`--control`): how far two identical direct callers
    come apart in one run is how finely this machine resolves a process's cost at all."""

    name = "direct_other_process"

    def __init__(self, model_dir: Path, image: Path):
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from bench.bench_vision import serve_direct; "
                "serve_direct(sys.argv[2], sys.argv[3])")
        self.process = subprocess.Popen([sys.executable, "-c", code, str(REPO), str(model_dir), str(image)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._ask("ready 0")

    def _ask(self, command: str) -> float:
        self.process.stdin.write(command + "\n")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the direct process exited (code {self.process.wait(10)})")
        return float(line)

    def request(self, max_tokens: int) -> float:
        """Direct's image request, timed inside the other process."""
        return self._ask(f"request {max_tokens}")

    def decode(self, max_tokens: int) -> float:
        """Direct's decode tokens/s, measured inside the other process."""
        return self._ask(f"decode {max_tokens}")

    def close(self) -> None:
        """Stop the process (it exits at the end of its input)."""
        self.process.stdin.close()
        self.process.wait(30)


def serve_direct(model_dir: str, image: str) -> None:
    """The loop of DirectElsewhere's process: a command per input line, a number per output line."""
    direct = Direct(Path(model_dir), Path(image))
    for line in sys.stdin:
        command, tokens = line.split()
        result = 0.0 if command == "ready" else getattr(direct, command)(int(tokens))
        print(result, flush=True)


class VisionServer(HTTPServer):
    """An OpenAI-compatible server asked about the image as a data URL."""

    def __init__(self, name: str, base: str, model: str, procs: list[Proc], image: Path):
        super().__init__(name, base, model, procs)
        mime = mimetypes.guess_type(image.name)[0] or "image/png"
        self.url = f"data:{mime};base64,{base64.b64encode(image.read_bytes()).decode()}"

    def _body(self, question: str, max_tokens: int, stream: bool) -> dict:
        content = [{"type": "image_url", "image_url": {"url": self.url}}, {"type": "text", "text": question}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "temperature": 0}
        return {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body

    def request(self, max_tokens: int) -> float:
        """Seconds for a whole short answer about the image over HTTP."""
        t0 = time.perf_counter()
        self.client.post_json("/v1/chat/completions", self._body(QUESTION, max_tokens, False))
        return time.perf_counter() - t0

    def decode(self, max_tokens: int) -> float:
        """Decode tokens/s of a streamed answer: content chunks from the first to the last."""
        return decode_rate(self.client.stream_lines("/v1/chat/completions",
                                                    self._body(LONG_QUESTION, max_tokens, True)))[0]


def start_mlx_vlm_server(model_dir: Path, image: Path) -> VisionServer:
    """Start mlx_vlm.server with the model preloaded; return once it answers."""
    port = free_port()
    server = Proc([sys.executable, "-m", "mlx_vlm.server", "--model", str(model_dir), "--host", "127.0.0.1",
                   "--port", str(port)], None, "mlx_vlm.server").start()
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/v1/models", 300)
    return VisionServer("mlx_vlm_server", base, str(model_dir), [server], image)


def ratios(samples: dict, servers: list[str], higher_is_better: bool) -> dict:
    """Each server's figure against direct: of the medians, and the median of same-round pairs."""
    base = statistics.median(samples["direct"])
    out = {}
    for name in servers:
        pairs = [(s / d if higher_is_better else d / s) for s, d in zip(samples[name], samples["direct"], strict=True)]
        median = statistics.median(samples[name])
        out[name] = {"of_medians": (median / base) if higher_is_better else (base / median),
                     "paired_median": statistics.median(pairs)}
    return out


def main() -> None:
    """Start every contestant, run the interleaved measurements and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="an mlx-vlm model directory")
    parser.add_argument("--image", type=Path, required=True, help="the picture every request asks about")
    parser.add_argument("--requests", type=int, default=20, help="timed image requests per contestant")
    parser.add_argument("--answer-tokens", type=int, default=16, help="max_tokens of a timed image request")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of a decode run")
    parser.add_argument("--decode-runs", type=int, default=5)
    parser.add_argument("--control", action="store_true",
                        help="also time direct in a second process: the machine's own difference between two processes")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    reexec_with_worker_blas()
    model_dir = same_weights_everywhere(args.model)
    report = {"machine": platform.node(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "model": str(args.model), "weights": str(model_dir), "image": str(args.image), "command": " ".join(sys.argv)}
    redis_url, redis_proc = start_redis()
    contestants = []
    try:
        contestants.append(Direct(model_dir, args.image))
        if args.control:
            contestants.append(DirectElsewhere(model_dir, args.image))
        mlxq = start_mlxq(model_dir, redis_url)
        contestants.append(VisionServer("mlxq", mlxq.base, mlxq.model, mlxq.procs, args.image))
        contestants.append(start_mlx_vlm_server(model_dir, args.image))
        interleaved(contestants, lambda c: c.request(args.answer_tokens), 1, WARMUP)
        requests = interleaved(contestants, lambda c: c.request(args.answer_tokens), args.requests, 1)
        decode = interleaved(contestants, lambda c: c.decode(args.max_tokens), args.decode_runs, 1)
    finally:
        for c in contestants:
            c.close()
        redis_proc.stop()
    servers = [c.name for c in contestants if c.name != "direct"]
    for name in ["direct", *servers]:
        report[name] = {"request_s": summary(requests[name]), "decode_tps": summary(decode[name]),
                        "decode_tps_runs": decode[name]}
    report["request_speed_vs_direct"] = ratios(requests, servers, higher_is_better=False)
    report["decode_vs_direct"] = ratios(decode, servers, higher_is_better=True)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
