"""The `mlxq` command: serve (web), worker, up (everything), models, transcribe, chat, admin."""

from __future__ import annotations

import os
import socket
import sys
from urllib.parse import urlsplit

import click

from jobs.settings import load_settings
from mlxq.adapters_cli import adapters
from mlxq.admin_cli import admin
from mlxq.chat_cli import chat
from mlxq.embed_cli import embed
from mlxq.models_cli import models
from mlxq.transcribe_cli import transcribe


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlxq", prog_name="mlxq")
def main():
    """mlxq: MLX models behind an OpenAI-compatible API, with a Redis job queue in the middle."""


def default_web_workers() -> int:
    """gunicorn processes by default: half the machine's cores, 2 to 8. A burst of 64 streamed chats reached the
    queue over ~90 ms through 2 (each call's validation and enqueue is one process's Python) and over ~35 ms through
    8 on a 16-core GPU host (H200, 2026-11-28, bench/device/ramp_probe.py: its time to first token 0.18-0.21 s
    against 0.12-0.14 s); a 2-core machine keeps 2, which leave the worker its core."""
    return min(8, max(2, (os.cpu_count() or 2) // 2))


def gunicorn_argv(host: str, port: int, workers: int) -> list[str]:
    """The gunicorn command line that runs the web tier with gevent workers."""
    return [sys.executable, "-m", "gunicorn", "--worker-class", "gevent", "--workers", str(workers),
            "--worker-connections", "1000", "--bind", f"{host}:{port}", "--graceful-timeout", "30",
            "--timeout", "60", "--access-logfile", "-", "--log-level", "info",
            "--config", "python:web.gunicorn_conf", "web.app:create_app()"]


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--workers", default=None, type=click.IntRange(min=1),
              help="gunicorn worker processes (default: half the cores, 2 to 8)")
def serve(host, port, workers):
    """Run the web tier (gunicorn with gevent workers)."""
    argv = gunicorn_argv(host, port, workers or default_web_workers())
    os.execv(argv[0], argv)


@main.command()
@click.option("--models", default=None, help="Serve only these models (comma-separated), from their own queues; "
              "several such workers, on one machine or many, share one Redis.")
@click.option("--name", default=None, help="Worker name (default: mlxq-<host>-<pid>-<random>).")
@click.option("--adapters", default=None, help="Mount these LoRA adapters (comma-separated names in the adapter "
              "store) at start, each on its base model.")
def worker(models, name, adapters):
    """Run the MLX worker (one process that owns the GPU and drains the queues)."""
    from workers.main import main as worker_main

    argv = [*(["--models", models] if models else []), *(["--name", name] if name else []),
            *(["--adapters", adapters] if adapters else [])]
    sys.exit(worker_main(argv))


@main.command("webhook-worker")
def webhook_worker():
    """Run the plain RQ worker that delivers webhooks (no MLX)."""
    argv = webhook_worker_argv(load_settings().redis_url)
    os.execv(argv[0], argv)


def webhook_worker_argv(redis_url: str) -> list[str]:
    """A plain RQ worker on `webhooks`, with the scheduler that runs its retries' backoff."""
    return [sys.executable, "-m", "rq.cli", "worker", "--with-scheduler", "--serializer",
            "rq.serializers.JSONSerializer", "--url", redis_url, "webhooks"]


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int, help="The API's port (`make run PORT=...`).")
@click.option("--web-workers", default=None, type=click.IntRange(min=1),
              help="gunicorn worker processes (default: half the cores, 2 to 8)")
@click.option("--workers", "worker_count", default=None, type=click.IntRange(min=1),
              help="MLX workers on the default device, each with its own copy of the models (default 1; with "
              "--gpus, one per GPU).")
@click.option("--gpus", default=None, help="One MLX worker per NVIDIA GPU, each seeing only its own: `all` (those "
              "CUDA_VISIBLE_DEVICES lists, else every GPU `nvidia-smi -L` lists) or device indices such as 0,1.")
def up(host, port, web_workers, worker_count, gpus):
    """Run everything: Redis (if none answers), web, the MLX workers and the webhook worker."""
    from mlxq.devstack import Stack, describe_port_problem, port_problem, worker_plans

    # Before anything starts: a taken port would otherwise show a banner for someone else's server.
    problem = port_problem(host, port)
    if problem:
        raise click.ClickException(f"cannot listen on {host}:{port}: {describe_port_problem(problem)} (another "
                                   "mlxq or another server may have it). Pick another port: `mlxq up --port PORT` "
                                   "or `make run PORT=PORT`.")
    devices = gpu_devices(gpus, worker_count)
    count = len(devices) if devices else worker_count or 1
    settings = load_settings()
    budget_mb = shared_budget_mb(settings, count, devices)
    stack = Stack(log=lambda line: click.echo(f"[mlxq up] {line}", err=True))
    redis_url = stack.ensure_redis(settings, settings.models_dir.parent / "redis")
    env = {"REDIS_URL": redis_url, "MLXQ_REDIS_URL": redis_url}
    plans = worker_plans(count, devices, f"mlxq-{socket.gethostname()}-{port}", env,
                         prompt_cache_dir(settings, redis_url), budget_mb)
    for plan in plans:
        stack.start(plan.child, plan.argv, plan.env)
    stack.start("webhooks", webhook_worker_argv(redis_url), env)
    stack.start("web", gunicorn_argv(host, port, web_workers or default_web_workers()), env)
    click.echo(banner(f"http://{host}:{port}", redis_url, settings, count, devices, budget_mb))
    sys.exit(stack.wait())


def gpu_devices(spec: str | None, count: int | None) -> list[str] | None:
    """The GPUs of `--gpus` (None without it); a ClickException for a spec that names none, or a `--workers`
    that is not their number."""
    if spec is None:
        return None
    from mlxq.devstack import parse_gpus

    try:
        devices = parse_gpus(spec)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if count is not None and count != len(devices):
        raise click.ClickException(f"--workers {count} with --gpus {spec} ({len(devices)} GPU(s): "
                                   f"{', '.join(devices)}): with --gpus there is one worker per GPU; drop --workers "
                                   "or name as many GPUs")
    return devices


def shared_budget_mb(settings, count: int, devices: list[str] | None) -> int | None:
    """MLXQ_MEMORY_BUDGET_MB for each of `count` workers sharing one device: what one would take by default,
    divided among them. None (each its own) for a lone worker, one per GPU, or a budget the operator set; None
    with a warning when the default cannot be found."""
    from mlxq.devstack import default_budget_bytes

    if count == 1 or devices or settings.memory_budget_mb > 0:
        return None
    total = default_budget_bytes()
    if total is None:
        click.echo(f"[mlxq up] warning: could not find the default memory budget to share among {count} workers; "
                   "each takes 70% of the device's memory: set MLXQ_MEMORY_BUDGET_MB (MiB per worker)", err=True)
        return None
    return max(1, total // count // 2**20)


def prompt_cache_dir(settings, redis_url: str) -> str:
    """The worker's prompt-cache disk tier under `mlxq up`: MLXQ_PROMPT_CACHE_DIR where set ("" turns it off),
    else this instance's own, beside its Redis data (<store>/../prompt-cache/<Redis port>-<db>): instances on
    one machine have their own Redis ports, and one that shares another's Redis shares its jobs; a worker that
    finds its directory in use by another goes without (workers/backends/prompt_disk.py)."""
    if "MLXQ_PROMPT_CACHE_DIR" in os.environ:
        return settings.prompt_cache_dir
    parts = urlsplit(redis_url)
    db = parts.path.strip("/") or "0"
    return str(settings.models_dir.parent / "prompt-cache" / f"{parts.port or 6379}-{db}")


def banner(base: str, redis_url: str, settings, workers: int = 1, gpus: list[str] | None = None,
           budget_mb: int | None = None) -> str:
    """What `mlxq up` prints once everything is starting: where things are, its MLX workers (how many, on which
    GPUs or sharing which memory budget), and a curl line to try."""
    key = f' -H "Authorization: Bearer {settings.api_keys[0]}"' if settings.api_keys else ""
    loads = "the worker loads its model" if workers == 1 else "each worker loads its model"
    if gpus:
        where = f", one per GPU ({', '.join(gpus)})"
    else:
        where = " on the default device" + (f", {budget_mb} MiB of memory budget each" if budget_mb else "")
    return (
        f"\nmlxq is starting ({loads} first; {base}/ready says when it can serve):\n"
        f"  Page        {base}/\n  API         {base}/v1\n  Swagger UI  {base}/docs\n"
        f"  OpenAPI     {base}/openapi.json\n  Dashboard   {base}/rq\n  Redis       {redis_url}\n"
        f"  Workers     {workers}{where}\n\n"
        f"Try:\n  curl -s {base}/v1/chat/completions{key} -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{settings.default_model}\", \"messages\": "
        "[{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], "
        "\"max_tokens\": 32, \"temperature\": 0}'\n\n"
        "Press Ctrl-C to stop everything.\n"
    )


main.add_command(models)
main.add_command(adapters)
main.add_command(transcribe)
main.add_command(chat)
main.add_command(embed)
main.add_command(admin)

if __name__ == "__main__":
    main()
