"""Embeddings throughput, side by side in one run: mlxq vs mlx-embeddings called directly vs onnxruntime.

A workload RxI is R requests of I texts each, all sent at once; a round repeats it, with new texts, until
`--min-requests` have gone (1x1: 64 texts one after the other by default). Contestants:
- mlxq: the service on the store entry `--served-name`, through the official openai client's
  `embeddings.create`, one thread per request;
- direct: mlx-embeddings' BERT in this process, fed as a batching server would feed it: every text of the
  workload sorted by token length, in passes of at most PASS_TEXTS padded to the longest of the pass
  (1x1: one text); tokenized with `tokenizers`, truncated to the model's max_seq_length;
- onnxruntime: the same weights as an ONNX graph built here from model.safetensors (no torch), on
  onnxruntime's CPU provider with one intra-op thread per core, the same tokens and passes as direct;
- torch (`--torch`): transformers' BertModel on PyTorch, on the GPU if there is one, sentence-transformers'
  pooling, the same tokens and passes as direct (the lent GPU machine has torch; this CPU machine does not).

Each round draws new texts (seeded sentences of 8-60 words, the same for every contestant), then runs
every workload on every contestant in turn, in rotating order. Before the rounds each workload runs once
unmeasured on each contestant, and a contestant whose vectors differ from direct's by 1e-3 or more stops
the run. Reported per workload and contestant: texts/s (a round's texts over its wall time, from the first
request to the last answer), each round's and the median; and mlxq ÷ direct, mlxq ÷ onnxruntime,
direct ÷ onnxruntime.

    python bench/bench_embeddings.py --model DIR [--rounds 3] [--workloads 1x1,64x32] [--min-requests 64]
        [--no-mlxq] [--no-onnx] [--torch] [--http-client] [--served-name minilm-l6] [--store DIR] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_text import reexec_with_worker_blas, start_mlxq  # noqa: E402
from bench.common import cpu_seconds, start_redis, write_report  # noqa: E402

PASS_TEXTS = 256
"""Most texts an in-process contestant encodes in one forward pass."""

WORDS = ("the a of to and in on for with from about after before while because although people city river "
         "market teacher student doctor engineer report system model question answer morning evening winter "
         "summer bridge garden library station kitchen window letter meeting project budget weather music "
         "history science language computer network village company train storm harvest quietly quickly "
         "carefully often never always again new old small large bright heavy early late local ancient "
         "reads writes builds finds opens closes carries explains remembers follows discusses repairs "
         "visits watches changes").split()


def make_texts(seed: str, n: int) -> list[str]:
    """n sentences of 8-60 words, the same for the same seed."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(8, 60))
        for i in range(6, len(words) - 1, rng.randint(7, 14)):
            words[i] += ","
        texts.append(" ".join(words).capitalize() + rng.choice(".?!"))
    return texts


def split(texts: list[str], inputs: int) -> list[list[str]]:
    """The texts as requests of `inputs` texts each."""
    return [texts[i:i + inputs] for i in range(0, len(texts), inputs)]


class Tokens:
    """The model's tokenizer as a server would run it: truncated to max_seq_length, no fixed padding."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        max_len = json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"]
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()  # all-MiniLM-L6-v2's tokenizer.json pads and truncates to 128 by itself
        self.tokenizer.enable_truncation(max_len)

    def passes(self, texts: list[str]):
        """(rows, ids, mask) per pass: the texts sorted by length, PASS_TEXTS at most, padded to the longest."""
        ids = [e.ids for e in self.tokenizer.encode_batch(texts)]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for start in range(0, len(order), PASS_TEXTS):
            rows = order[start:start + PASS_TEXTS]
            longest = max(len(ids[i]) for i in rows)
            batch, mask = np.zeros((len(rows), longest), np.int64), np.zeros((len(rows), longest), np.int64)
            for r, i in enumerate(rows):
                batch[r, :len(ids[i])], mask[r, :len(ids[i])] = ids[i], 1
            yield rows, batch, mask


class InProcess:
    """An engine in the bench's process: every text of a workload in passes (Tokens.passes)."""

    def __init__(self, tokens: Tokens):
        self.tokens = tokens

    def run(self, requests: list[list[str]]) -> np.ndarray:
        """Every request's vectors, in order."""
        texts = [t for r in requests for t in r]
        out = None
        for rows, ids, mask in self.tokens.passes(texts):
            vectors = self.forward(ids, mask)
            out = np.empty((len(texts), vectors.shape[1]), np.float32) if out is None else out
            out[rows] = vectors
        return out


class Direct(InProcess):
    """mlx-embeddings' model, its own mean pooling and normalization (`text_embeds`)."""

    name = "direct"

    def __init__(self, model_dir: Path, tokens: Tokens):
        super().__init__(tokens)
        try:
            from mlx_embeddings.utils import load_model
        except ImportError:
            sys.exit("the direct contestant needs mlx-embeddings: pip install 'mlx-embeddings>=0.1'")
        self.model = load_model(model_dir)

    def forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The pass's normalized sentence vectors."""
        import mlx.core as mx

        return np.array(self.model(mx.array(ids), attention_mask=mx.array(mask)).text_embeds)


class OnnxRuntime(InProcess):
    """The model as an ONNX graph (build_onnx) on onnxruntime's CPU provider, one intra-op thread per core."""

    name = "onnxruntime"

    def __init__(self, model_dir: Path, tokens: Tokens):
        super().__init__(tokens)
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = os.cpu_count()
        path = build_onnx(model_dir, Path(tempfile.mkdtemp(prefix="mlxq-bench-onnx-")) / "model.onnx")
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The pass's normalized sentence vectors."""
        return self.session.run(None, {"input_ids": ids, "attention_mask": mask})[0]


class Torch(InProcess):
    """transformers' BertModel on PyTorch (the GPU when there is one) with sentence-transformers' mean pooling and
    normalization: what sentence-transformers runs for this model, without its package (which this CPU machine has no
    torch for; the lent GPU machine has torch and transformers)."""

    name = "torch"

    def __init__(self, model_dir: Path, tokens: Tokens):
        super().__init__(tokens)
        import torch
        from transformers import AutoModel

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModel.from_pretrained(str(model_dir), torch_dtype=torch.float32).to(self.device).eval()

    def forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The pass's normalized sentence vectors."""
        torch = self.torch
        with torch.inference_mode():
            ids_t, mask_t = torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device)
            hidden = self.model(input_ids=ids_t, attention_mask=mask_t).last_hidden_state
            weights = mask_t.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy()


class Graph:
    """An ONNX graph under construction: each op's one output gets a fresh name."""

    def __init__(self):
        self.nodes, self.initializers = [], []

    def const(self, value) -> str:
        """An initializer holding `value` (float32 for floats, int64 for ints)."""
        from onnx import numpy_helper

        value = np.asarray(value)
        value = value.astype(np.float32 if value.dtype.kind == "f" else np.int64)
        name = f"c{len(self.initializers)}"
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op_type: str, *inputs: str, **attributes) -> str:
        """Add a node; return its output's name."""
        from onnx import helper

        name = f"t{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], **attributes))
        return name


def build_onnx(model_dir: Path, out: Path) -> Path:
    """Write the BERT forward, mean pooling over real tokens and L2 normalization as an ONNX graph (opset 17)."""
    try:
        import onnx
    except ImportError:
        sys.exit("the onnxruntime contestant builds its graph with onnx: pip install 'onnx>=1.16' (or --no-onnx)")
    from onnx import TensorProto, helper
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    w = load_file(str(model_dir / "model.safetensors"))
    g, eps = Graph(), config["layer_norm_eps"]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]

    def linear(x: str, name: str) -> str:
        return g.op("Add", g.op("MatMul", x, g.const(w[name + ".weight"].T)), g.const(w[name + ".bias"]))

    def norm(x: str, name: str) -> str:
        return g.op("LayerNormalization", x, g.const(w[name + ".weight"]), g.const(w[name + ".bias"]), epsilon=eps)

    def split_heads(x: str, perm: list[int]) -> str:
        return g.op("Transpose", g.op("Reshape", x, g.const([0, 0, heads, hidden // heads])), perm=perm)

    length = g.op("Slice", g.op("Shape", "input_ids"), g.const([1]), g.const([2]))
    # Token type 0 throughout: its row folds into the position table.
    positions = w["embeddings.position_embeddings.weight"] + w["embeddings.token_type_embeddings.weight"][0]
    x = g.op("Add", g.op("Gather", g.const(w["embeddings.word_embeddings.weight"]), "input_ids"),
             g.op("Slice", g.const(positions), g.const([0]), length, g.const([0])))
    x = norm(x, "embeddings.LayerNorm")
    mask = g.op("Cast", "attention_mask", to=TensorProto.FLOAT)
    padding = g.op("Unsqueeze", g.op("Mul", g.op("Sub", g.const(1.0), mask), g.const(-10000.0)), g.const([1, 2]))
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q = split_heads(linear(x, p + "attention.self.query"), [0, 2, 1, 3])
        k = split_heads(linear(x, p + "attention.self.key"), [0, 2, 3, 1])
        v = split_heads(linear(x, p + "attention.self.value"), [0, 2, 1, 3])
        scores = g.op("Add", g.op("Mul", g.op("MatMul", q, k), g.const((hidden // heads) ** -0.5)), padding)
        context = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
        context = g.op("Reshape", g.op("Transpose", context, perm=[0, 2, 1, 3]), g.const([0, 0, hidden]))
        x = norm(g.op("Add", x, linear(context, p + "attention.output.dense")), p + "attention.output.LayerNorm")
        h = linear(x, p + "intermediate.dense")
        erf = g.op("Erf", g.op("Div", h, g.const(2 ** 0.5)))
        h = g.op("Mul", g.op("Mul", h, g.op("Add", erf, g.const(1.0))), g.const(0.5))  # exact GELU
        x = norm(g.op("Add", x, linear(h, p + "output.dense")), p + "output.LayerNorm")
    weights = g.op("Unsqueeze", mask, g.const([2]))
    count = g.op("Max", g.op("ReduceSum", weights, g.const([1]), keepdims=0), g.const(1e-9))
    pooled = g.op("Div", g.op("ReduceSum", g.op("Mul", x, weights), g.const([1]), keepdims=0), count)
    length2 = g.op("Max", g.op("ReduceL2", pooled, axes=[1], keepdims=1), g.const(1e-9))
    g.nodes.append(helper.make_node("Div", [pooled, length2], ["embeddings"]))
    graph = helper.make_graph(
        g.nodes, "sentence_bert",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "length"]) for n in ("input_ids", "attention_mask")],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", hidden])], g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(out))
    return out


class Mlxq:
    """mlxq's POST /v1/embeddings through the openai client, one thread per request."""

    name = "mlxq"

    def __init__(self, base: str, model: str, threads: int):
        from openai import OpenAI

        self.client = OpenAI(base_url=base + "/v1", api_key="bench", max_retries=0, timeout=600)
        self.model, self.pool = model, ThreadPoolExecutor(threads)

    def run(self, requests: list[list[str]]) -> np.ndarray:
        """Every request's vectors, in order."""
        return np.concatenate(list(self.pool.map(self.one, requests)))

    def one(self, texts: list[str]) -> np.ndarray:
        """One request's vectors (the client asks for base64 and decodes it, as it does by default)."""
        data = sorted(self.client.embeddings.create(model=self.model, input=texts).data, key=lambda d: d.index)
        return np.array([d.embedding for d in data], np.float32)


class MlxqHttp(Mlxq):
    """The same calls through plain httpx, the vectors decoded with numpy: what the service costs without the
    openai client's parsing (it turns each vector into a list of Python floats and validates them)."""

    name = "mlxq_http"

    def __init__(self, base: str, model: str, threads: int):
        import httpx

        self.http = httpx.Client(base_url=base, timeout=600, limits=httpx.Limits(max_connections=threads))
        self.model, self.pool = model, ThreadPoolExecutor(threads)

    def one(self, texts: list[str]) -> np.ndarray:
        """One request's vectors, asked for as base64."""
        import base64

        response = self.http.post("/v1/embeddings", json={"model": self.model, "input": texts,
                                                          "encoding_format": "base64"})
        response.raise_for_status()
        data = sorted(response.json()["data"], key=lambda d: d["index"])
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data])


CPU_USE: dict[str, dict[str, list[float]]] = {}
"""Per workload, for mlxq's rounds: the CPU seconds per second of wall time of each of its processes and of this
bench's (the client threads); a process near 1.0 (or the web's two near 2.0 together) is the limit."""


def cpu_now(procs: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each watched process, and by this one (the clients)."""
    times = os.times()
    return {**{name: cpu_seconds(pid) for name, pid in procs.items()}, "client": times.user + times.system}


def texts_per_s(contestant, runs: list[list[list[str]]], key: str = "") -> float:
    """Texts per second of wall time for the workload's runs, one after the other (for mlxq, its processes' CPU
    use noted in CPU_USE)."""
    watched = getattr(contestant, "procs", None)
    before = cpu_now(watched) if watched else None
    start = time.perf_counter()
    for requests in runs:
        contestant.run(requests)
    wall = time.perf_counter() - start
    if watched:
        after = cpu_now(watched)
        for name in after:
            CPU_USE.setdefault(f"{key} {contestant.name}", {}).setdefault(name, []).append(
                (after[name] - before[name]) / wall)
    return sum(len(t) for requests in runs for t in requests) / wall


def check_and_warm(contestants: list, workloads: list[tuple[int, int]]) -> dict:
    """Run each workload once unmeasured on every contestant; the largest difference from direct's vectors
    per contestant (exit if one reaches 1e-3)."""
    diffs = {}
    for requests, inputs in workloads:
        batch = split(make_texts(f"warm-up {requests}x{inputs}", requests * inputs), inputs)
        vectors = {c.name: c.run(batch) for c in contestants}
        for name, v in vectors.items():
            diffs[name] = max(diffs.get(name, 0.0), float(np.abs(v - vectors["direct"]).max()))
    print("max abs difference from direct's vectors:", diffs, file=sys.stderr)
    if wrong := [name for name, d in diffs.items() if not d < 1e-3]:
        sys.exit(f"{', '.join(wrong)}: vectors differ from direct's by 1e-3 or more; not timed")
    return diffs


def measure(contestants: list, workloads: list[tuple[int, int]], rounds: int, min_requests: int) -> dict:
    """texts/s per workload and contestant, each round's; new texts every round, rotating order."""
    samples = {f"{r}x{i}": {c.name: [] for c in contestants} for r, i in workloads}
    for n in range(rounds):
        for requests, inputs in workloads:
            key = f"{requests}x{inputs}"
            runs = [split(make_texts(f"round {n} {key} run {k}", requests * inputs), inputs)
                    for k in range(-(-min_requests // requests))]
            for c in contestants[n % len(contestants):] + contestants[:n % len(contestants)]:
                samples[key][c.name].append(texts_per_s(c, runs, key))
    return samples


def summarize(samples: dict) -> dict:
    """Per workload: each contestant's rounds and median, and the ratios of medians between contestants."""
    report = {}
    for key, by_name in samples.items():
        entry = {name: {"texts_per_s_p50": round(statistics.median(s), 1), "texts_per_s_runs": [round(x, 1) for x in s]}
                 for name, s in by_name.items()}
        for a, b in (("mlxq", "direct"), ("mlxq", "onnxruntime"), ("mlxq", "torch"), ("mlxq_http", "direct"),
                     ("mlxq_http", "torch"), ("direct", "onnxruntime"), ("direct", "torch")):
            if a in entry and b in entry:
                entry[f"{a}_vs_{b}"] = round(entry[a]["texts_per_s_p50"] / entry[b]["texts_per_s_p50"], 3)
        report[key] = entry
    return report


def print_table(workloads: dict) -> None:
    """The report's figures as a small table on stdout."""
    print(f"\n{'workload':<9} {'contestant':<12} {'texts/s p50':>11}  rounds")
    for key, entry in workloads.items():
        for name, figures in entry.items():
            if isinstance(figures, dict):
                print(f"{key:<9} {name:<12} {figures['texts_per_s_p50']:>11.1f}  {figures['texts_per_s_runs']}")
        for name, ratio in entry.items():
            if not isinstance(ratio, dict):
                print(f"{key:<9} {name.replace('_vs_', ' ÷ '):<26} {ratio:.3f}")


def main() -> None:
    """Load or start every contestant, check their vectors, run the interleaved rounds, print the report."""
    from jobs.settings import load_settings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="the model directory (default: the store entry --served-name)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default="1x1,64x32", help="REQUESTSxINPUTS, comma-separated")
    parser.add_argument("--min-requests", type=int, default=64, help="requests per workload and round, at least")
    parser.add_argument("--served-name", default="minilm-l6", help="the store entry mlxq serves")
    parser.add_argument("--store", type=Path, default=load_settings().models_dir, help="the model store mlxq reads")
    parser.add_argument("--no-mlxq", action="store_true")
    parser.add_argument("--no-onnx", action="store_true")
    parser.add_argument("--torch", action="store_true", help="add transformers' BertModel on PyTorch (GPU if any)")
    parser.add_argument("--http-client", action="store_true",
                        help="add mlxq through plain httpx (mlxq_http): the service without the openai client's parsing")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model_dir = args.model or args.store / args.served_name
    workloads = [tuple(int(n) for n in w.split("x")) for w in args.workloads.split(",")]
    if not args.no_mlxq and not (args.store / args.served_name / "mlxq.json").is_file():
        sys.exit(f"mlxq serves store entries: no {args.store / args.served_name / 'mlxq.json'} (or --no-mlxq)")
    reexec_with_worker_blas()
    import mlx.core as mx

    report = {"machine": platform.node(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "model": str(model_dir), "mlx_device": str(mx.default_device()), "cores": os.cpu_count(),
              "load_average_start": os.getloadavg(), "command": " ".join(sys.argv),
              "min_requests": args.min_requests,
              "passes": f"direct and onnxruntime: all texts of a workload run sorted by token length, in passes of "
                        f"at most {PASS_TEXTS} padded to the longest of the pass (1x1: one text a pass)"}
    tokens = Tokens(model_dir)
    contestants = [Direct(model_dir, tokens)] + ([] if args.no_onnx else [OnnxRuntime(model_dir, tokens)])
    if args.torch:
        contestants.append(Torch(model_dir, tokens))
        report["torch_device"] = contestants[-1].device
    procs = []
    try:
        if not args.no_mlxq:
            redis_url, redis_proc = start_redis()
            procs.append(redis_proc)
            server = start_mlxq(model_dir, redis_url, env_extra={
                "MLXQ_MODELS_DIR": str(args.store), "MLXQ_DEFAULT_MODEL": args.served_name})
            procs += server.procs
            contestants.insert(0, Mlxq(server.base, args.served_name, max(r for r, _ in workloads)))
            if args.http_client:
                contestants.insert(1, MlxqHttp(server.base, args.served_name, max(r for r, _ in workloads)))
            watched = {proc.name: proc.process.pid for proc in [*server.procs, redis_proc]}
            for c in contestants[:2 if args.http_client else 1]:
                c.procs = watched
        report["max_abs_diff_vs_direct"] = check_and_warm(contestants, workloads)
        samples = measure(contestants, workloads, args.rounds, args.min_requests)
    finally:
        for proc in reversed(procs):
            proc.stop()
    report["load_average_end"] = os.getloadavg()
    report["workloads"] = summarize(samples)
    report["mlxq_cpu_per_wall"] = {run: {name: round(statistics.median(v), 2) for name, v in by.items()}
                                   for run, by in CPU_USE.items()}
    write_report(report, args.out)
    print_table(report["workloads"])
    for run, by in report["mlxq_cpu_per_wall"].items():
        print(f"{run}: CPU s/s " + ", ".join(f"{name} {v}" for name, v in by.items()))


if __name__ == "__main__":
    main()
