"""Settings shared by web and worker: defaults, then environment (MLXQ_*), then explicit overrides."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path


def _default_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlxq"


@dataclass(frozen=True)
class Settings:
    """Every knob of mlxq. Each field's environment variable is MLXQ_<NAME> unless noted."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis connection URL (environment: REDIS_URL or MLXQ_REDIS_URL)."""

    models_dir: Path = field(default_factory=lambda: _default_home() / "models")
    """The local model store: one MLX model directory per name."""

    adapters_dir: Path = field(default_factory=lambda: _default_home() / "adapters")
    """The local adapter store: one mlx_lm.lora adapter (adapters.safetensors + adapter_config.json) per name."""

    spool_dir: Path = field(default_factory=lambda: _default_home() / "spool")
    """Directory shared by web and worker where uploads are spooled (never into Redis)."""

    default_model: str = "smollm2-135m"
    """Model used when a request names none (completions, chat)."""

    api_keys: tuple[str, ...] = ()
    """Bearer keys accepted on every endpoint; empty means no auth (comma-separated in the env)."""

    admin_key: str = ""
    """Key required for /rq and admin endpoints when set."""

    key_limits: str = ""
    """A JSON file of per-key limits (requests per minute, concurrent, queued async jobs, tokens and audio seconds
    per day: jobs/limits.py, docs/operations.md); the admin API's entries win over it. "": only those."""

    max_body_kb: int = 1024
    """Largest JSON request body accepted, in KiB (413 above it, refused before reading)."""

    max_upload_mb: int = 512
    """Largest audio upload accepted, in MiB."""

    max_audio_s: float = 4 * 3600.0
    """Longest audio accepted for transcription, in seconds: checked from the file's header when it is
    uploaded, and enforced while the worker decodes it (a header may understate the length)."""

    speech_batch: int = 0
    """Speech pieces decoded at once when a transcription uses chunking_strategy "auto" (voice activity
    detection); 0 picks the measured default of the platform (workers/backends/whisper_batch.py)."""

    body_timeout_s: float = 30.0
    """Longest wait for the next piece of a request body: a client that stops sending is answered 408."""

    max_queued: int = 200
    """Queue length above which new work is refused with 503 + Retry-After."""

    sync_timeout_s: float = 300.0
    """How long a synchronous call waits for its job before answering 504 with the job id."""

    result_ttl_s: int = 24 * 3600
    """How long results, job records and event logs are kept after a job ends."""

    event_log_max: int = 50_000
    """Cap on the per-job replay log (events kept for late joiners)."""

    max_tokens_limit: int = 8192
    """Upper bound on max_tokens a client may ask for."""

    worker_heartbeat_s: float = 1.0
    """How often the worker refreshes its liveness key and the running job's heartbeat."""

    worker_dead_after_s: float = 6.0
    """A worker whose liveness key is older than this is considered dead."""

    memory_budget_mb: int = 0
    """Memory the worker may fill with resident models, their KV caches and MLX's buffer cache (0: 70% of RAM /
    GPU memory)."""

    cache_limit_mb: int = -1
    """Most memory MLX keeps in its cache of freed buffers for reuse, in MiB, taken from memory_budget_mb
    (-1: a sixteenth of the budget on a GPU, at most 32 MiB on a CPU; 0: no cache). The worker also empties it
    whenever it goes idle."""

    max_batch: int = 0
    """Most text requests decoding together in the worker (0: the worker's measured default for its
    device; docs/performance.md)."""

    prompt_cache_mb: int = 512
    """Memory kept for the KV caches of finished requests, reused by later requests that start alike."""

    prompt_cache_dir: str = ""
    """Directory of the prompt cache's disk tier: kept KV caches of long prompts written to files, so they
    survive a worker's restart; "" turns it off (the default of a bare worker; `mlxq up` gives its worker a
    directory of its own instance). One worker per directory: another one finding it in use goes without."""

    prompt_cache_disk_mb: int = 4096
    """Disk space of the prompt cache's disk tier, in MiB (least recently used entries go first)."""

    model_ttl_s: float = -1.0
    """How long a model stays loaded once no request uses it, in seconds (a request's `keep_alive` sets its own):
    -1 keeps it until the memory budget evicts it, 0 unloads it as soon as it is idle. Pinned models stay."""

    kv_bits: int = 0
    """Bits per element of the text models' KV caches: 8 or 4 quantize them (more sequences fit the memory
    budget, at a small cost in quality: docs/performance.md), 0 keeps them in the model's dtype. A model's
    `mlxq.json` may set its own (`kv_bits`, `kv_group_size`: docs/models.md)."""

    kv_group_size: int = 64
    """Elements of a quantized KV cache that share one scale and bias (32, 64 or 128)."""

    stream_interval_ms: int = 20
    """Least time between two streamed text events of a job; tokens generated meanwhile go out together
    (the first token and the last never wait). Fewer, larger events leave more time to generation."""

    webhook_secret: str = ""
    """HMAC-SHA256 secret used to sign webhook deliveries."""

    webhook_allow_private: bool = False
    """Allow webhook URLs that resolve to loopback or private addresses (tests, LANs)."""

    max_images: int = 5
    """Most image_url parts in one chat request (the whole conversation, not one message)."""

    max_image_mb: int = 20
    """Largest image accepted, in MiB of image bytes (decoded from a data URL, or fetched)."""

    max_images_mb: int = 50
    """Most image bytes in one chat request, all its images together, in MiB."""

    max_image_pixels: int = 50_000_000
    """Most pixels (width x height) in one image, read from its header before anything is decoded.
    Pillow refuses above about 179 million pixels on its own, so larger values change nothing."""

    image_fetch_timeout_s: float = 10.0
    """Deadline for fetching one http(s) image_url, redirects included, in seconds."""

    image_fetch_allow_private: bool = False
    """Allow image URLs that resolve to loopback or private addresses (tests, LANs)."""

    audio_fetch_timeout_s: float = 1800.0
    """Deadline for fetching an async job's `file_url` (redirects included), in seconds; the file is also held
    to MLXQ_MAX_UPLOAD_MB and MLXQ_MAX_AUDIO_S like an upload."""

    audio_fetch_allow_private: bool = False
    """Allow `file_url`s that resolve to loopback or private addresses (tests, LANs)."""

    max_audio_parts: int = 5
    """Most input_audio parts in one chat request (each also counts against max_upload_mb and max_audio_s)."""

    def with_overrides(self, **overrides) -> "Settings":
        """Return a copy with the given fields replaced (test and CLI overrides)."""
        return replace(self, **{k: _coerce(self, k, v) for k, v in overrides.items()})


def _coerce(settings: Settings, name: str, value):
    """Convert a string (from the environment) to the type of the field's default."""
    current = getattr(settings, name)
    if not isinstance(value, str):
        return Path(value) if isinstance(current, Path) else value
    if isinstance(current, bool):
        return value.strip().lower() in ("1", "true", "yes", "on")
    try:
        if isinstance(current, int):
            return int(value)
        if isinstance(current, float):
            return float(value)
    except ValueError:
        raise ValueError(f"MLXQ_{name.upper()}={value!r} is not a number") from None
    if isinstance(current, Path):
        return Path(value).expanduser()
    if isinstance(current, tuple):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return value


def load_settings(overrides: dict | None = None, environ=None) -> Settings:
    """Build Settings from defaults, then the environment, then `overrides`."""
    environ = os.environ if environ is None else environ
    base = Settings()
    values = {}
    for f in fields(Settings):
        key = "MLXQ_" + f.name.upper()
        if key in environ:
            values[f.name] = environ[key]
    if "REDIS_URL" in environ and "MLXQ_REDIS_URL" not in environ:
        values["redis_url"] = environ["REDIS_URL"]
    settings = base.with_overrides(**values)
    return settings.with_overrides(**(overrides or {}))
