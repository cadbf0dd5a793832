"""The worker's metrics, kept in Redis, and the collector the web's /metrics serves them with.

Workers (any number, on any machine) add to counters and histograms held in Redis hashes, so every
worker's counts add up and the web tier exposes them without importing MLX; a scrape also reads
live figures from Redis: queue depths, the oldest waiting job's age, live workers, their resident
models and memory (from the state each worker writes with its heartbeat, jobs.workers).

Storage: one hash per metric (`keys.metric_key`); a field is the JSON list of the label values,
then `|v` (a counter), `|sum`, `|count` or `|le=<bound>` (a histogram bucket, not cumulative).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from jobs import keys, queues, workers

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 7200.0)
"""Histogram buckets for durations, from a token's latency to a long transcription."""


@dataclass(frozen=True)
class Metric:
    """A counter or histogram the workers write and /metrics reads."""

    name: str
    kind: str  # "counter" | "histogram"
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = SECONDS


QUEUE_WAIT = Metric("mlxq_queue_wait_seconds", "histogram", "Time from enqueue to a worker starting the job",
                    ("queue", "kind"))
JOB_DURATION = Metric("mlxq_job_duration_seconds", "histogram", "Time a worker spent on a job, start to end",
                      ("kind", "outcome"))
TIME_TO_FIRST_TOKEN = Metric("mlxq_time_to_first_token_seconds", "histogram",
                             "From enqueue to the first generated text leaving the worker", ("model",))
GENERATED_TOKENS = Metric("mlxq_generated_tokens_total", "counter", "Completion tokens generated", ("model",))
AUDIO_SECONDS = Metric("mlxq_audio_seconds_transcribed_total", "counter", "Seconds of audio transcribed",
                       ("model",))
MODEL_LOAD = Metric("mlxq_model_load_seconds", "histogram", "Model loads (the count) and how long each took",
                    ("model",))
PROMPT_CACHE_LOOKUPS = Metric("mlxq_prompt_cache_lookups_total", "counter",
                              "Prompts looked up in a tier of the prompt cache (memory, disk), by result (hit, miss)",
                              ("tier", "result"))
PROMPT_CACHE_TOKENS = Metric("mlxq_prompt_cache_tokens_total", "counter",
                             "Prompt tokens resumed from a tier of the prompt cache instead of processed", ("tier",))
KEY_USAGE = {
    "requests": Metric("mlxq_key_requests_total", "counter", "Requests answered, per key (its id, never the key) and "
                       "model", ("key", "model")),
    "prompt_tokens": Metric("mlxq_key_prompt_tokens_total", "counter", "Prompt tokens, per key and model",
                            ("key", "model")),
    "completion_tokens": Metric("mlxq_key_completion_tokens_total", "counter",
                                "Completion tokens, per key and model", ("key", "model")),
    "cached_tokens": Metric("mlxq_key_cached_tokens_total", "counter",
                            "Prompt tokens resumed from the prompt cache, per key and model", ("key", "model")),
    "audio_seconds": Metric("mlxq_key_audio_seconds_total", "counter", "Seconds of audio transcribed or translated, "
                            "per key and model", ("key", "model")),
    "images": Metric("mlxq_key_images_total", "counter", "Images in chats, per key and model", ("key", "model")),
    "embedding_inputs": Metric("mlxq_key_embedding_inputs_total", "counter", "Inputs embedded, per key and model",
                               ("key", "model")),
}
"""What each key used (jobs/usage.py's figures) as counters: the same series as `GET /v1/admin/usage`, all time."""

METRICS = (QUEUE_WAIT, JOB_DURATION, TIME_TO_FIRST_TOKEN, GENERATED_TOKENS, AUDIO_SECONDS, MODEL_LOAD,
           PROMPT_CACHE_LOOKUPS, PROMPT_CACHE_TOKENS, *KEY_USAGE.values())

WORKER_MEMORY = {
    "rss_bytes": ("mlxq_worker_resident_memory_bytes", "A worker process's resident memory (RSS)"),
    "rss_peak_bytes": ("mlxq_worker_resident_memory_peak_bytes", "A worker process's highest resident memory"),
    "mlx_active_bytes": ("mlxq_worker_mlx_active_bytes", "Bytes of MLX arrays alive in a worker"),
    "mlx_cache_bytes": ("mlxq_worker_mlx_cache_bytes", "Bytes of freed buffers MLX keeps for reuse in a worker"),
    "mlx_peak_bytes": ("mlxq_worker_mlx_peak_bytes", "Most bytes of MLX arrays alive at once in a worker"),
    "cache_limit_bytes": ("mlxq_worker_mlx_cache_limit_bytes", "The bound on a worker's MLX buffer cache"),
    "budget_bytes": ("mlxq_worker_memory_budget_bytes", "A worker's memory budget (models, KV caches, MLX's cache)"),
    "used_bytes": ("mlxq_worker_memory_used_bytes", "A worker's budget taken by resident models and MLX's cache"),
}
"""Gauges read from each live worker's state (its heartbeat's memory figures and budget): field -> (name, help)."""


def metric_key(metric: Metric) -> str:
    """The Redis hash holding a metric."""
    return keys.metric_key(metric.name)


def record(conn: redis.Redis, samples: list[tuple[Metric, tuple, float]], also=None) -> None:
    """Add samples, each (metric, label values, value), in one round trip: a counter grows by the value,
    a histogram observes it. They land together (MULTI/EXEC): a scrape sees all of a job's samples or none.
    `also(pipe)` queues more commands in the same transaction (the keys' usage of the day: jobs/usage.py)."""
    if not samples:
        return
    with conn.pipeline(transaction=True) as pipe:
        if also is not None:
            also(pipe)
        for metric, labels, value in samples:
            prefix, key = json.dumps([str(v) for v in labels]), metric_key(metric)
            if metric.kind == "counter":
                pipe.hincrbyfloat(key, f"{prefix}|v", value)
                continue
            bucket = next((b for b in metric.buckets if value <= b), "+Inf")
            pipe.hincrby(key, f"{prefix}|le={bucket}", 1)
            pipe.hincrbyfloat(key, f"{prefix}|sum", value)
            pipe.hincrby(key, f"{prefix}|count", 1)
        pipe.execute()


class RedisCollector:
    """A prometheus_client collector: the workers' metrics and the queues' live state, read at scrape time."""

    def __init__(self, conn: redis.Redis, settings):
        self.conn, self.settings = conn, settings

    def collect(self):
        """Yield every metric family (prometheus_client calls this on each scrape)."""
        # One snapshot of every series (MULTI/EXEC): read one by one, a job recorded between two reads showed
        # in one metric and not yet in another (its duration counted, its queue wait not).
        with self.conn.pipeline(transaction=True) as pipe:
            for metric in METRICS:
                pipe.hgetall(metric_key(metric))
            snapshot = pipe.execute()
        for metric, fields in zip(METRICS, snapshot, strict=True):
            yield (_counter if metric.kind == "counter" else _histogram)(metric, fields)
        yield from self._queues()
        yield from self._workers()

    def _queues(self):
        depth = GaugeMetricFamily("mlxq_queue_depth", "Jobs waiting in a queue", labels=["queue"])
        oldest = GaugeMetricFamily("mlxq_queue_oldest_age_seconds", "Age of the oldest job waiting in a queue",
                                   labels=["queue"])
        for row in queues.depths(self.conn):
            depth.add_metric([row["queue"]], row["depth"])
            oldest.add_metric([row["queue"]], row["oldest_age_s"])
        yield depth
        yield oldest

    def _workers(self):
        alive = GaugeMetricFamily("mlxq_workers", "Live MLX workers")
        resident = GaugeMetricFamily("mlxq_resident_model_bytes", "Bytes of a model resident in a worker",
                                     labels=["worker", "model"])
        memory = {field: GaugeMetricFamily(name, text, labels=["worker"])
                  for field, (name, text) in WORKER_MEMORY.items()}
        states = workers.states(self.conn)
        alive.add_metric([], len(states))
        for state in states:
            for model in state.get("models", []):
                resident.add_metric([state["name"], model["id"]], model["bytes"])
            figures = {**state, **state.get("memory", {})}  # a worker of an older version may lack some
            for field, family in memory.items():
                if field in figures:
                    family.add_metric([state["name"]], figures[field])
        yield alive
        yield resident
        yield from memory.values()


def _split(fields: dict) -> dict[tuple, dict[str, float]]:
    """Hash fields grouped by label values: {labels: {suffix: value}}."""
    grouped: dict[tuple, dict[str, float]] = defaultdict(dict)
    for field, value in fields.items():
        prefix, _, suffix = field.decode().rpartition("|")
        grouped[tuple(json.loads(prefix))][suffix] = float(value)
    return grouped


def _counter(metric: Metric, fields: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(metric.name.removesuffix("_total"), metric.help, labels=metric.labels)
    for labels, values in _split(fields).items():
        family.add_metric(list(labels), values.get("v", 0.0))
    return family


def _histogram(metric: Metric, fields: dict) -> HistogramMetricFamily:
    family = HistogramMetricFamily(metric.name, metric.help, labels=metric.labels)
    for labels, values in _split(fields).items():
        running, buckets = 0.0, []
        for bound in (*metric.buckets, "+Inf"):
            running += values.get(f"le={bound}", 0.0)
            buckets.append(("+Inf" if bound == "+Inf" else str(float(bound)), running))
        family.add_metric(list(labels), buckets, values.get("sum", 0.0))
    return family
