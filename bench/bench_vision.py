"""Vision benchmark, side by side in one run: mlxq vs mlx-vlm called directly vs mlx_vlm.server.

Measures (1) the time of an image request (one image as a data URL, a short answer) as a caller
sees it, and (2) decode tokens/s of a longer answer about the image, through each path. The
contestants are up at once and measured in interleaved blocks (as bench_text.py does), so a
machine whose speed drifts moves everyone's figures alike.

    python bench/bench_vision.py --model ~/.cache/mlxq/models/shapes-vlm-toy --image picture.png

With `--concurrency N[,N...]` (issue 34) it measures instead N streamed image chats at once, each on a
client thread of its own, each with a picture and a question of its own and new every round (the picture
with a numbered mark, the same size; the question with the request's and the round's number), so no
image or prompt cache has seen them: aggregate completion tokens/s (every answer's completion tokens over
the wall time from the first send to the last answer), time to first token p50 and failures, each the
median of `--rounds` rounds, for mlxq (N at once), mlx_vlm.server (N at once: it batches concurrent
requests itself) and mlxq one by one (the same N chats in turn; each TTFT from its own send); then mlxq ÷
mlx_vlm.server and mlxq ÷ one by one. Every N runs once unmeasured on each contestant first (MLX compiles
each new batch shape), then the rounds in rotating order. `--no-server` leaves mlx_vlm.server out.

    python bench/bench_vision.py --model DIR --image picture.png --concurrency 1,4,8 [--rounds 3]
        [--max-tokens 128] [--temperature 1.0] [--no-server] [--control]

With `--repeat-rounds K` it also measures, for mlxq and mlx_vlm.server (with `--control` a second one too),
K rounds of the same image chat sent twice: a picture new to every cache (a numbered mark, as above) with
QUESTION, streamed, greedy, max_tokens 8, then the identical request again. Per contestant: the median time to
first content chunk of the first request and of the repeat, repeat ÷ first (the median of each round's ratio,
and the ratio of the medians), and the prompt tokens and `usage.prompt_tokens_details.cached_tokens` each
reported (mlxq: the repeat resumes from its prompt cache, vision tower included). It runs after the mode's own
measurements, on the same servers, after one unmeasured round each; `--requests 0` leaves out the single
requests and decode (and direct), so it runs on its own. mlx_vlm.server 0.7.10 keeps vision features of recent
images (`--vision-cache-size`, 20) but its prefix cache (APC) only with APC_ENABLED=1 in its environment, which
it inherits from this benchmark's; the report says which it ran with. With APC its repeat reports cached_tokens
in whole blocks (APC_BLOCK_SIZE, 16 tokens), without it 0.

    python bench/bench_vision.py --model DIR --image picture.png --requests 0 --repeat-rounds 10 [--no-server]

Prints a JSON report (and writes it to --out), in concurrency and repeat mode a table too (on stderr). Start-up
of each server is excluded.
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import io
import itertools
import json
import mimetypes
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_concurrency import combine, figures  # noqa: E402
from bench.bench_text import (  # noqa: E402
    HTTPServer,
    interleaved,
    reexec_with_worker_blas,
    start_mlxq,
    summary,
)
from bench.common import (  # noqa: E402
    KeepAliveClient,
    Proc,
    decode_rate,
    free_port,
    start_redis,
    wait_http,
    write_report,
)

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

    def _body(self, question: str, max_tokens: int, stream: bool, url: str | None = None,
              temperature: float = 0.0) -> dict:
        content = [{"type": "image_url", "image_url": {"url": url or self.url}}, {"type": "text", "text": question}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "temperature": temperature}
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


def start_mlx_vlm_server(model_dir: Path, image: Path, name: str = "mlx_vlm_server") -> VisionServer:
    """Start mlx_vlm.server with the model preloaded; return once it answers, or exit saying why it could not."""
    port = free_port()
    log_name = "mlx_vlm.server" if name == "mlx_vlm_server" else name
    server = Proc([sys.executable, "-m", "mlx_vlm.server", "--model", str(model_dir), "--host", "127.0.0.1",
                   "--port", str(port)], None, log_name).start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            wait_http(base + "/v1/models", 2)
            return VisionServer(name, base, str(model_dir), [server], image)
        except TimeoutError:
            if server.process.poll() is not None or time.monotonic() > deadline:
                server.stop()
                sys.exit(f"{log_name} did not start (a package it needs missing? see {server.log}); "
                         "--no-server leaves it out")


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


PICTURES = itertools.count(1)
"""The number each concurrency request's picture is marked with: a picture no cache has seen."""
ROUNDS = itertools.count()
"""The number of each concurrency round, in its questions: a prompt no cache has seen."""


def marked_pictures(image: Path, count: int) -> list[str]:
    """`count` PNG data URLs of the picture, each with a number never used before drawn in its top-left
    corner (three squares, a byte each, big enough to outlast the processor's resizing); the size, and
    so the number of image tokens, is the picture's own."""
    from PIL import Image

    picture = Image.open(image).convert("RGB")
    side = max(1, min(picture.size) // 32)
    urls = []
    for _ in range(count):
        marked = picture.copy()
        for i, byte in enumerate(next(PICTURES).to_bytes(3, "big")):
            marked.paste((byte, 255 - byte, byte), (i * side, 0, (i + 1) * side, side))
        buffer = io.BytesIO()
        marked.save(buffer, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
    return urls


def one_chat(base: str, body: dict, started: float) -> dict:
    """Stream one chat on an HTTP client of its own; its time to first token (from `started`), completion
    tokens and end, or its failure, as bench_concurrency's one_stream records them, and the prompt and
    cached tokens its usage reported."""
    client = KeepAliveClient(base)
    first = tokens = None
    usage: dict = {}
    finished = False
    try:
        for line in client.stream_lines("/v1/chat/completions", body):
            finished = finished or line == "data: [DONE]"
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
                tokens = usage["completion_tokens"]
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
        end = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 (every failure counts, whatever it is)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200], "end": time.perf_counter()}
    finally:
        client.close()
    ok = finished and tokens is not None and first is not None
    return {"ok": ok, "ttft": (first - started) if first else None, "tokens": tokens or 0, "end": end,
            "decode_tps": (tokens - 1) / (end - first) if ok and tokens > 1 and end > first else None,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def at_once(base: str, bodies: list[dict]) -> dict:
    """Every chat sent together, each on a client thread of its own; the round's figures."""
    results: dict[int, dict] = {}
    started = time.perf_counter()

    def send(index: int, body: dict) -> None:
        results[index] = one_chat(base, body, started)

    threads = [threading.Thread(target=send, args=(i, body)) for i, body in enumerate(bodies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    return round_figures(len(bodies), started, results)


def one_by_one(base: str, bodies: list[dict]) -> dict:
    """The same chats sent one after another; the round's figures (each TTFT from the chat's own send)."""
    started = time.perf_counter()
    results = {i: one_chat(base, body, time.perf_counter()) for i, body in enumerate(bodies)}
    return round_figures(len(bodies), started, results)


def round_figures(n: int, started: float, results: dict[int, dict]) -> dict:
    """bench_concurrency's figures of a round, and the completion tokens its answers came to."""
    return {**figures(n, started, results), "completion_tokens": sum(r["tokens"] for r in results.values() if r["ok"])}


class Chats:
    """A concurrency contestant: a server, and whether a round's chats go to it at once or one by one."""

    def __init__(self, server: VisionServer, image: Path, together: bool, name: str | None = None):
        self.server, self.image, self.together = server, image, together
        self.name = name or server.name

    def round(self, n: int, max_tokens: int, temperature: float) -> dict:
        """N new chats (new pictures, new questions), made before the clock starts; the round's figures
        and its completion tokens."""
        number = next(ROUNDS)
        bodies = [self.server._body(f"Request {i} of round {number}: {LONG_QUESTION}", max_tokens, True, url,
                                    temperature)
                  for i, url in enumerate(marked_pictures(self.image, n))]
        return (at_once if self.together else one_by_one)(self.server.base, bodies)


def concurrency_ratios(runs: dict[str, list[dict]]) -> dict:
    """mlxq's aggregate tokens/s ÷ each other contestant's: of the medians, and the median of same-round pairs."""
    mine = [r["aggregate_tps"] for r in runs["mlxq"]]
    out = {}
    for name, other in runs.items():
        if name == "mlxq":
            continue
        theirs = [r["aggregate_tps"] for r in other]
        pairs = [a / b for a, b in zip(mine, theirs, strict=True) if b]
        out[f"mlxq_vs_{name.removeprefix('mlxq_')}"] = {
            "of_medians": statistics.median(mine) / statistics.median(theirs) if statistics.median(theirs) else None,
            "paired_median": statistics.median(pairs) if pairs else None}
    return out


def measure_concurrency(contestants: list[Chats], counts: list[int], args) -> tuple[dict, dict]:
    """Every N: a warm-up round on each contestant, then the rounds interleaved; figures and ratios by N."""
    results, ratios_by_n = {}, {}
    for n in counts:
        interleaved(contestants, lambda c, n=n: c.round(n, 16, args.temperature), 1, 1)  # this N's shapes, compiled
        runs = interleaved(contestants, lambda c, n=n: c.round(n, args.max_tokens, args.temperature), args.rounds, 1)
        results[str(n)] = {name: {**combine(rounds), "completion_tokens_each_round":
                                  [r["completion_tokens"] for r in rounds]} for name, rounds in runs.items()}
        ratios_by_n[str(n)] = concurrency_ratios(runs)
    return results, ratios_by_n


def server_notes(server: VisionServer) -> dict:
    """What mlx_vlm.server says of itself: its version, whether it batches concurrent requests and whether
    its prefix cache (APC) is on."""
    try:
        health = httpx.get(server.base + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        health = {}  # an older server without /health
    return {"mlx_vlm_version": importlib.metadata.version("mlx-vlm"),
            "continuous_batching_enabled": health.get("continuous_batching_enabled"),
            "apc_enabled": health.get("apc_enabled")}


def run_concurrency(args, model_dir: Path, report: dict) -> None:
    """Start mlxq (and mlx_vlm.server), run every N's rounds and put the figures in the report."""
    redis_url, redis_proc = start_redis()
    servers = []
    try:
        mlxq = start_mlxq(model_dir, redis_url)
        servers.append(VisionServer("mlxq", mlxq.base, mlxq.model, mlxq.procs, args.image))
        contestants = [Chats(servers[0], args.image, True)]
        if args.server:
            servers.append(start_mlx_vlm_server(model_dir, args.image))
            report["mlx_vlm_server"] = server_notes(servers[-1])
            contestants.append(Chats(servers[-1], args.image, True))
        if args.control:
            servers.append(start_mlx_vlm_server(model_dir, args.image, "mlx_vlm_server_2"))
            contestants.append(Chats(servers[-1], args.image, True))
        contestants.append(Chats(servers[0], args.image, False, "mlxq_one_by_one"))
        counts = [int(n) for n in args.concurrency.split(",")]
        report["concurrency"], report["concurrency_ratios"] = measure_concurrency(contestants, counts, args)
        if args.repeat_rounds:
            report["repeat_ttft"] = measure_repeat(servers, args.image, args.repeat_rounds)
    finally:
        for server in servers:
            server.close()
        redis_proc.stop()


def num(value, digits: int = 0) -> str:
    """A figure of a summary table: `-` where there is none."""
    return "-" if value is None else f"{value:.{digits}f}"


def concurrency_summary(report: dict) -> str:
    """The concurrency report as a table: per N each contestant's tok/s, TTFT and failures, then the ratios."""
    lines = [f"{'N':>3} {'contestant':18} {'tok/s':>8} {'ttft p50':>9} {'failed':>6}  rounds' tok/s, tokens"]
    for n, contestants in report["concurrency"].items():
        for name, c in contestants.items():
            lines.append(f"{n:>3} {name:18} {num(c['aggregate_tps'], 1):>8} {num(c['ttft_p50_s'], 3):>9} "
                         f"{c['failed']:>6}  {[round(x['aggregate_tps'], 1) for x in c['each_round']]}, "
                         f"{c['completion_tokens_each_round']} {c['errors'][:1] or ''}")
        lines.append(f"{n:>3} mlxq ÷ " + ", ".join(
            f"{k.removeprefix('mlxq_vs_')} {num(v['of_medians'], 2)} (paired {num(v['paired_median'], 2)})"
            for k, v in report["concurrency_ratios"][n].items()))
    if "mlx_vlm_server" in report:
        lines.append(f"mlx_vlm.server: {report['mlx_vlm_server']}")
    return "\n".join(lines)


REPEAT_TOKENS = 8
"""max_tokens of each `--repeat-rounds` request: only its time to first token counts."""


class Repeats:
    """A `--repeat-rounds` contestant: a server asked about a picture new to it, then asked the same again."""

    def __init__(self, server: VisionServer, image: Path):
        self.server, self.image, self.name = server, image, server.name

    def round(self) -> dict:
        """A new marked picture and QUESTION, streamed and greedy (the body made before the clock starts), then
        the identical body again: each one's result as one_chat records it, its TTFT from its own send."""
        body = self.server._body(QUESTION, REPEAT_TOKENS, True, marked_pictures(self.image, 1)[0], 0.0)
        first = one_chat(self.server.base, body, time.perf_counter())
        return {"first": first, "repeat": one_chat(self.server.base, body, time.perf_counter())}


def median_of(values: list) -> float | None:
    """The median of the values there are (None: none)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def repeat_figures(rounds: list[dict]) -> dict:
    """A contestant's repeat rounds: the median TTFT of the first request and of the repeat, repeat ÷ first
    (the median of each round's ratio, and the ratio of the medians), the prompt tokens and the cached tokens
    the first and the repeat reported (medians), every round kept."""
    ok = [r for r in rounds if r["first"]["ok"] and r["repeat"]["ok"]]
    first, repeat = median_of([r["first"]["ttft"] for r in ok]), median_of([r["repeat"]["ttft"] for r in ok])
    return {"rounds": len(rounds), "completed": len(ok), "failed": len(rounds) - len(ok),
            "first_ttft_p50_s": first, "repeat_ttft_p50_s": repeat,
            "repeat_vs_first": {"paired_median": median_of([r["repeat"]["ttft"] / r["first"]["ttft"] for r in ok]),
                                "of_medians": repeat / first if first and repeat is not None else None},
            "prompt_tokens_p50": median_of([r["repeat"]["prompt_tokens"] for r in ok]),
            "first_cached_tokens_p50": median_of([r["first"]["cached_tokens"] for r in ok]),
            "repeat_cached_tokens_p50": median_of([r["repeat"]["cached_tokens"] for r in ok]),
            "each_round": [{"first_ttft_s": r["first"].get("ttft"), "repeat_ttft_s": r["repeat"].get("ttft"),
                            "prompt_tokens": r["repeat"].get("prompt_tokens"),
                            "first_cached_tokens": r["first"].get("cached_tokens"),
                            "repeat_cached_tokens": r["repeat"].get("cached_tokens")} for r in rounds],
            "errors": sorted({x["error"] for r in rounds for x in r.values() if "error" in x})[:5]}


def measure_repeat(servers: list[VisionServer], image: Path, rounds: int) -> dict:
    """`--repeat-rounds`: one unmeasured round on each server, then `rounds` interleaved; the report's part."""
    contestants = [Repeats(server, image) for server in servers]
    interleaved(contestants, lambda c: c.round(), 1, 1)  # the kernels of a first and of a resumed prefill, compiled
    runs = interleaved(contestants, lambda c: c.round(), rounds, 1)
    out = {"rounds": rounds, "max_tokens": REPEAT_TOKENS, "temperature": 0, "question": QUESTION,
           "results": {name: repeat_figures(samples) for name, samples in runs.items()}}
    mlx_vlm = [server for server in servers if server.name == "mlx_vlm_server"]
    if mlx_vlm:
        out["mlx_vlm_server"] = server_notes(mlx_vlm[0])
    return out


def repeat_summary(report: dict) -> str:
    """The repeat measurement as a table: per contestant the first and the repeat's TTFT, repeat ÷ first, the
    cached tokens of the first and of the repeat against the prompt's, and every round's TTFTs."""
    r = report["repeat_ttft"]
    lines = [f"the same image chat twice: {r['rounds']} rounds, max_tokens {r['max_tokens']}, greedy",
             f"{'contestant':18} {'ttft 1st':>9} {'ttft rep':>9} {'rep÷1st':>8} {'paired':>7} "
             f"{'cached 1st/rep/prompt':>22} {'failed':>6}  rounds' ttft 1st→rep"]
    for name, c in r["results"].items():
        ratio = c["repeat_vs_first"]
        cached = "/".join(num(c[k]) for k in ("first_cached_tokens_p50", "repeat_cached_tokens_p50",
                                              "prompt_tokens_p50"))
        each = [f"{num(x['first_ttft_s'], 3)}→{num(x['repeat_ttft_s'], 3)}" for x in c["each_round"]]
        lines.append(f"{name:18} {num(c['first_ttft_p50_s'], 3):>9} {num(c['repeat_ttft_p50_s'], 3):>9} "
                     f"{num(ratio['of_medians'], 2):>8} {num(ratio['paired_median'], 2):>7} "
                     f"{cached:>22} {c['failed']:>6}  {', '.join(each)} {c['errors'][:1] or ''}")
    if "mlx_vlm_server" in r and "concurrency" not in report:  # (the concurrency table has said it)
        lines.append(f"mlx_vlm.server: {r['mlx_vlm_server']}")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="an mlx-vlm model directory")
    parser.add_argument("--image", type=Path, required=True, help="the picture every request asks about")
    parser.add_argument("--requests", type=int, default=20,
                        help="timed image requests per contestant (0: neither these nor the decode runs, nor direct: "
                             "with --repeat-rounds, that measurement alone)")
    parser.add_argument("--answer-tokens", type=int, default=16, help="max_tokens of a timed image request")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="max_tokens of a decode run, and of each request of a concurrency round")
    parser.add_argument("--decode-runs", type=int, default=5)
    parser.add_argument("--control", action="store_true",
                        help="also time direct in a second process: the machine's own difference between two "
                             "processes (with --concurrency, or --requests 0: a second mlx_vlm.server)")
    parser.add_argument("--concurrency", metavar="N[,N...]",
                        help="instead of the single requests: N image chats at once, for each N")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per N and contestant (--concurrency)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="the concurrency chats' temperature (1.0: OpenAI's default; 0: greedy); "
                             "the single requests are greedy")
    parser.add_argument("--repeat-rounds", type=int, default=0, metavar="K",
                        help="also K rounds of a new picture's chat sent twice: TTFT of the first and of the "
                             "identical repeat, and the cached tokens the repeat reports (0: off)")
    parser.add_argument("--server", action=argparse.BooleanOptionalAction, default=True,
                        help="mlx_vlm.server as a contestant (--no-server: where it cannot run, a package missing)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.control and (args.concurrency or not args.requests) and not args.server:
        parser.error("--control with --concurrency or --requests 0 is a second mlx_vlm.server: it needs --server")
    if not (args.concurrency or args.requests or args.repeat_rounds):
        parser.error("--requests 0 without --concurrency or --repeat-rounds measures nothing")
    return args


def run_single(args, model_dir: Path, report: dict) -> None:
    """Start every contestant, run the interleaved single requests and decode runs (unless --requests 0) and
    the repeat rounds (with --repeat-rounds); put the figures in the report."""
    redis_url, redis_proc = start_redis()
    contestants = []
    try:
        if args.requests:
            contestants.append(Direct(model_dir, args.image))
            if args.control:
                contestants.append(DirectElsewhere(model_dir, args.image))
        mlxq = start_mlxq(model_dir, redis_url)
        contestants.append(VisionServer("mlxq", mlxq.base, mlxq.model, mlxq.procs, args.image))
        if args.server:
            contestants.append(start_mlx_vlm_server(model_dir, args.image))
        if args.control and not args.requests:  # the repeat rounds' control
            contestants.append(start_mlx_vlm_server(model_dir, args.image, "mlx_vlm_server_2"))
        if args.requests:
            interleaved(contestants, lambda c: c.request(args.answer_tokens), 1, WARMUP)
            requests = interleaved(contestants, lambda c: c.request(args.answer_tokens), args.requests, 1)
            decode = interleaved(contestants, lambda c: c.decode(args.max_tokens), args.decode_runs, 1)
        if args.repeat_rounds:
            report["repeat_ttft"] = measure_repeat([c for c in contestants if isinstance(c, VisionServer)],
                                                   args.image, args.repeat_rounds)
    finally:
        for c in contestants:
            c.close()
        redis_proc.stop()
    if args.requests:
        servers = [c.name for c in contestants if c.name != "direct"]
        for name in ["direct", *servers]:
            report[name] = {"request_s": summary(requests[name]), "decode_tps": summary(decode[name]),
                            "decode_tps_runs": decode[name]}
        report["request_speed_vs_direct"] = ratios(requests, servers, higher_is_better=False)
        report["decode_vs_direct"] = ratios(decode, servers, higher_is_better=True)


def main() -> None:
    """Start every contestant, run the interleaved measurements and print the report."""
    args = parse_args()
    reexec_with_worker_blas()
    model_dir = same_weights_everywhere(args.model)
    report = {"machine": platform.node(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "model": str(args.model), "weights": str(model_dir), "image": str(args.image), "command": " ".join(sys.argv)}
    if args.concurrency:
        report.update(max_tokens=args.max_tokens, temperature=args.temperature, rounds=args.rounds)
        run_concurrency(args, model_dir, report)
    else:
        run_single(args, model_dir, report)
    write_report(report, args.out)
    if "concurrency" in report:
        print(concurrency_summary(report), file=sys.stderr)
    if "repeat_ttft" in report:
        print(repeat_summary(report), file=sys.stderr)


if __name__ == "__main__":
    main()
