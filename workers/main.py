"""The worker entry point (`python -m workers.main`, `mlxq worker`): one process that owns MLX.

Start-up: settings, the platform choice (re-exec with a faster BLAS on Linux CPUs), the model
manager and backends, recovery of what a dead worker left, warming the default model, then the
scheduler's loop on the main thread. A heartbeat thread keeps the liveness key, the running jobs'
RQ heartbeats and the worker's rq-dashboard entry fresh, and sweeps for dead workers' jobs.
SIGTERM: a warm stop (the interactive job finishes, a long batch job is handed back to the queue at
its next piece), then exit 0; a second SIGTERM (or SIGINT) stops at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid

import redis

from jobs import keys, kv_quant, workers
from jobs.connection import get_redis
from jobs.errors import JobError
from jobs.lifecycle import liveness_value
from jobs.queues import worker_queue_names
from jobs.settings import Settings, load_settings
from jobs.store import ModelNotFound, resolve
from workers import memory, platform, process_setup, rqjobs, worker_metrics
from workers.backends.control import public_models
from workers.recovery import clean_spool, recover

log = logging.getLogger("workers.main")

RECOVERY_EVERY_S = 5.0
"""Seconds between sweeps for jobs that a dead worker left behind."""

SPOOL_CLEAN_EVERY_S = 3600.0
"""Seconds between removals of spooled uploads whose jobs ended long ago."""

DEFAULT_MAX_BATCH = {"cuda": 64, "metal": 32, "cpu": 16}
"""MLXQ_MAX_BATCH when it is 0, by device. Measured with bench/bench_concurrency.py (docs/performance.md):
on the H100 (Llama-1B shape) tokens/s still grew from 32 to 64 at once (2,879 to 3,591) with first
tokens within 0.6 s; on the 2-core CPU (demo model) 16 at once gave 48 tokens/s against 36 with 8.
Metal is not measured here (no Mac): 32 sits between the two."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options (everything else comes from settings / the environment)."""
    parser = argparse.ArgumentParser(prog="mlxq worker", description=__doc__.splitlines()[0])
    parser.add_argument("--burst", action="store_true", help="drain the queues, then exit")
    parser.add_argument("--name", default=None, help="worker name (default: mlxq-<host>-<pid>-<random>)")
    parser.add_argument("--models", default=None,
                        help="serve only these models (comma-separated ids or aliases), from their own queues; "
                             "default: any model, from the shared queues")
    parser.add_argument("--adapters", default=None,
                        help="mount these LoRA adapters (comma-separated names in the adapter store) at start")
    return parser.parse_args(argv)


def dedicated_models(spec: str | None, settings: Settings) -> list[str] | None:
    """The catalog ids of `--models` (None: any model); exits naming a model the store does not have."""
    if not spec:
        return None
    ids = []
    for ref in (part.strip() for part in spec.split(",") if part.strip()):
        try:
            ids.append(resolve(ref, settings).id)
        except ModelNotFound as exc:
            raise SystemExit(f"mlxq worker --models: {exc}") from None
    return list(dict.fromkeys(ids))


def configure_logging() -> None:
    """Log to stderr with timestamps, at MLXQ_LOG_LEVEL (INFO by default; DEBUG adds every slow step)."""
    logging.basicConfig(level=os.environ.get("MLXQ_LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def build_scheduler(settings: Settings, name: str, info: platform.PlatformInfo | None = None,
                    burst: bool = False, serves: list[str] | None = None):
    """The scheduler with its model manager and backends (imports MLX: call it after the BLAS choice)."""
    from workers.backends import default_backends
    from workers.models import ModelManager, memory_budget_bytes
    from workers.scheduler import Scheduler

    info = info or platform.detect()
    budget = memory_budget_bytes(settings.memory_budget_mb, info.backend)
    try:
        cache = memory.cache_limit_bytes(settings.cache_limit_mb, budget, info.backend)
        kv = kv_quant.of_settings(settings)
    except ValueError as exc:
        raise SystemExit(f"mlxq worker: {exc}") from None
    if kv is not None:
        log.info("text models' KV caches: %s", kv)
    memory.limit_cache(cache)
    backends = default_backends()
    loaders = {backend.model_kind: backend.load for backend in backends.values() if backend.model_kind}
    conn = get_redis(settings.redis_url, patient=True)
    models = ModelManager(budget, info, loaders, cache_bytes=cache,
                          on_load=lambda resident: worker_metrics.model_loaded(conn, resident))
    models.ttl_s = settings.model_ttl_s
    return Scheduler(conn, settings, models, backends, name, burst=burst,
                     max_batch=settings.max_batch or default_max_batch(info.backend),
                     queue_names=worker_queue_names(serves), serves=serves)


def default_max_batch(device: str) -> int:
    """How many text requests decode together by default: measured per device (docs/performance.md)."""
    return DEFAULT_MAX_BATCH.get(device, DEFAULT_MAX_BATCH["cpu"])


def warm_models(scheduler, settings: Settings) -> None:
    """Load the worker's models now (its --models, else the default model) so the first request does not
    pay for it; one missing or too large warns."""
    for ref in scheduler.serves or [settings.default_model]:
        try:
            resident = scheduler.models.load(resolve(ref, settings))
            kv_quant.for_model(resident.info.path, settings)  # a bad mlxq.json kv_bits is told now, not at a request
        except (ModelNotFound, JobError, ValueError) as exc:
            # The worker can still serve other models; requests for this one get the same error.
            log.warning("model %s not warmed: %s", ref, exc)
            continue
        log.info("warmed %s in %.2fs", resident.info.id, resident.load_s)


def mount_adapters(scheduler, settings: Settings, spec: str | None) -> None:
    """Apply the `--adapters` to their base models now (loading them); exits naming an adapter the store does not
    have, warns for one that cannot be applied (its requests get the same error)."""
    from jobs.adapters import adapter_entry
    from jobs.contract import AdapterRef

    for name in (part.strip() for part in (spec or "").split(",") if part.strip()):
        entry = adapter_entry(settings, name)
        if entry is None:
            raise SystemExit(f"mlxq worker --adapters: adapter {name!r} is not in the adapter store "
                             f"({settings.adapters_dir})")
        try:
            scheduler.models.mount(resolve(entry.base, settings), AdapterRef(entry.name, str(entry.path), entry.base))
        except (ModelNotFound, JobError) as exc:
            log.warning("adapter %s not mounted: %s", name, exc)
            continue
        log.info("mounted adapter %s on %s", name, entry.base)


BEAT_RETRY_S = 0.1
"""After a failed heartbeat, how soon the next try. An outage longer than worker_dead_after_s lets the
liveness key expire; until a beat lands again, a web process following one of this worker's jobs finds
no key and fails the live job with worker_died. Retrying at the heartbeat's own pace (a second) left that
window open for up to a second or two after Redis came back (the web's event hub reconnects 0.4 s after losing
Redis at the soonest)."""


class Heartbeat:
    """A thread: liveness key, running jobs' RQ heartbeats, the rq-dashboard entry, recovery sweeps."""

    def __init__(self, scheduler, settings: Settings):
        self.scheduler, self.settings = scheduler, settings
        self.conn = scheduler.conn
        self.key = keys.worker_alive(scheduler.name)
        self.value = liveness_value(scheduler.name)
        self.rq_worker = rqjobs.register(list(scheduler.queues.values()), self.conn, scheduler.name)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._next_recovery = self._next_spool_clean = 0.0
        self.started_at = int(time.time())
        self.device = getattr(getattr(scheduler.models, "platform", None), "backend", None)
        self.idle_release = memory.IdleRelease()  # freed memory goes back when the work is done
        kv = kv_quant.of_settings(settings)  # the worker's own (a model's mlxq.json may set another)
        self.kv_quantization = {"bits": kv.bits, "group_size": kv.group_size} if kv else None

    def start(self) -> "Heartbeat":
        """Beat once now, then every settings.worker_heartbeat_s."""
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating; remove the liveness key and the dashboard entry (a clean exit is seen at once)."""
        self._stop.set()
        self._thread.join(10)
        try:
            self.conn.delete(self.key, keys.worker_state(self.scheduler.name))
            self.rq_worker.register_death()
        except redis.RedisError as exc:
            log.warning("could not unregister: %s", exc)

    def _run(self) -> None:
        wait = self.settings.worker_heartbeat_s
        while not self._stop.wait(wait):
            try:
                self.beat()
                wait = self.settings.worker_heartbeat_s
            except redis.RedisError as exc:  # keep beating: Redis may come back before the key expires
                if wait != BEAT_RETRY_S:  # the first failure of this outage
                    log.warning("heartbeat failed: %s; trying again every %gs until Redis answers", exc, BEAT_RETRY_S)
                log.debug("heartbeat failed: %s", exc)
                wait = BEAT_RETRY_S

    def state(self, active: list) -> dict:
        """What the admin API and /metrics show of this worker (read from the scheduler's thread-safe views)."""
        models = self.scheduler.models
        return {"host": socket.gethostname(), "pid": os.getpid(), "started_at": self.started_at,
                "serves": self.scheduler.serves, "queues": list(self.scheduler.queues),
                "device": self.device, "budget_bytes": models.budget_bytes,
                "used_bytes": models.cache_bytes + sum(m["bytes"] + sum(a["bytes"] for a in m.get("adapters", ()))
                                                       for m in models.snapshot),
                "cache_limit_bytes": models.cache_bytes, "memory": memory.figures(),
                "kv_quantization": self.kv_quantization,
                "models": public_models(models.snapshot),
                "jobs": [{"id": t.run.job_id, "kind": getattr(t.request, "kind", None), "queue": t.lane,
                          "model": getattr(getattr(t.request, "model", None), "id", None),
                          "running_s": round(time.monotonic() - t.started, 3)} for t in active]}

    def beat(self) -> None:
        """One heartbeat; now and then a recovery sweep and a spool cleanup."""
        self.conn.set(self.key, self.value, px=int(self.settings.worker_dead_after_s * 1000))
        active = self.scheduler.active()
        rqjobs.heartbeat([(task.job, task.execution) for task in active])
        self.rq_worker.heartbeat()
        self.rq_worker.set_state("busy" if active else "idle")
        self.idle_release.beat(bool(active))
        workers.write_state(self.conn, self.scheduler.name, self.state(active), self.settings.worker_dead_after_s)
        now = time.monotonic()
        if now >= self._next_recovery:
            self._next_recovery = now + RECOVERY_EVERY_S
            recover(self.conn, self.settings, self.scheduler.name)
        if now >= self._next_spool_clean:
            self._next_spool_clean = now + SPOOL_CLEAN_EVERY_S
            clean_spool(self.settings)


def _exit_before_work(signum, frame) -> None:
    """SIGTERM before the worker takes jobs: nothing to finish, so leave at once.

    os._exit, not sys.exit: the model may be mid-load (MLX threads busy), and an interpreter
    finalizing under running MLX work can abort instead of exiting.
    """
    log.info("SIGTERM before taking jobs: exiting")
    logging.shutdown()
    os._exit(0)


def _install_stop_signals(scheduler) -> None:
    """First SIGTERM: a warm stop. A second one, or SIGINT: stop now (jobs end with worker_shutdown)."""

    def on_signal(signum, frame):
        cold = scheduler.stopping or signum == signal.SIGINT
        log.info("%s: %s stop", signal.Signals(signum).name, "cold" if cold else "warm")
        scheduler.stop(cold=cold)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def apply_platform_choice(argv: list[str]) -> platform.PlatformInfo:
    """Measure (or read the cached) BLAS choice and re-exec with it preloaded when it is not yet."""
    device = platform.backend()
    blas = platform.choose_blas(device=device)
    platform.reexec_with_blas(blas, argv)  # returns only when no re-exec is needed
    return platform.PlatformInfo(device, blas, platform.float32_max_bytes())


def main(argv: list[str] | None = None) -> int:
    """Run the worker until SIGTERM/SIGINT (or, with --burst, until the queues are empty)."""
    signal.signal(signal.SIGTERM, _exit_before_work)  # until the scheduler's loop takes over
    process_setup.apply()  # before MLX loads
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    configure_logging()
    try:
        settings = load_settings()
    except ValueError as exc:  # a setting that is not a number: said plainly, not as a traceback
        raise SystemExit(f"mlxq worker: {exc}") from None
    info = apply_platform_choice(argv)
    process_setup.fix_mmap_threshold(info.backend)
    name = args.name or f"mlxq-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    scheduler = build_scheduler(settings, name, info, burst=args.burst,
                                serves=dedicated_models(args.models, settings))
    recover(scheduler.conn, settings, name)
    warm_models(scheduler, settings)
    mount_adapters(scheduler, settings, args.adapters)
    heartbeat = Heartbeat(scheduler, settings).start()
    log.info("worker %s on queues %s | backend %s | BLAS %s | model budget %.0f MiB | float32 up to %.0f MiB",
             name, ",".join(scheduler.queues), info.backend, info.blas.describe(),
             scheduler.models.budget_bytes / 2**20, info.float32_max_bytes / 2**20)
    _install_stop_signals(scheduler)
    try:
        scheduler.run()
    finally:
        heartbeat.stop()
    log.info("worker %s stopped", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
