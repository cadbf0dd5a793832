"""Per-key limits at the door (jobs/limits.py): 429 with Retry-After and OpenAI's `x-ratelimit-*` headers.

Requests that start work are counted: a POST to a model endpoint (chat, completions, Responses,
Messages, audio, embeddings, async jobs). Reading a job, listing models and the admin API are not;
the admin key is never limited. A synchronous request counts as in flight until its answer (its
whole stream) has gone out; an async job counts as queued until it ends (jobs/lifecycle.py).
Every counted request of a limited key carries the headers, so a client can slow down before it is
refused: `x-ratelimit-{limit,remaining,reset}-requests` (the minute's requests) and `-tokens`
(the day's tokens; `-audio-seconds` on audio endpoints), resets as OpenAI writes them ("12s", "3h2m1s").
"""

from __future__ import annotations

import math
import uuid

from flask import Flask, g, request

from jobs import limits, usage
from web.auth import caller
from web.errors import APIError
from web.services import Services, services

WORK_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/embeddings",
    "/v1/audio/transcriptions", "/v1/audio/translations",
    "/v1/jobs/transcriptions", "/v1/jobs/chat/completions", "/v1/jobs/embeddings",
})
"""POSTs that start work."""

AUDIO_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations", "/v1/jobs/transcriptions"})
"""Work held to the audio seconds of the day; the rest to its tokens."""

ASYNC_PREFIX = "/v1/jobs/"
"""Async submissions: answered at once, counted by `queued`, not as in flight."""

MESSAGES = {
    "requests_per_minute": "{limit:g} requests per minute",
    "concurrent": "{limit:g} requests at once",
    "tokens_per_day": "{limit:g} tokens a day (UTC)",
    "audio_seconds_per_day": "{limit:g} seconds of audio a day (UTC)",
    "queued": "{limit:g} async jobs queued or running",
}


def duration(seconds: float) -> str:
    """A reset time as OpenAI's headers write it: "59s", "6m0s", "3h2m1s"."""
    total = max(0, math.ceil(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _refusal(verdict: limits.Verdict) -> APIError:
    """The 429 for a request over `verdict.refused`."""
    limit = getattr(verdict.limits, verdict.refused)
    retry = max(1, math.ceil(verdict.retry_after_s))
    return APIError(429, f"Rate limit reached for this key: {MESSAGES[verdict.refused].format(limit=limit)}. "
                         f"Retry in {duration(retry)}.", "rate_limit_exceeded", limit=verdict.refused,
                    headers={"Retry-After": str(retry), **headers(verdict)})


def headers(verdict: limits.Verdict) -> dict[str, str]:
    """The `x-ratelimit-*` headers for a counted request of a key with limits."""
    found, lim = {}, verdict.limits
    if lim.requests_per_minute is not None:
        left = verdict.requests_left if verdict.requests_left is not None else lim.requests_per_minute
        found.update({"x-ratelimit-limit-requests": str(lim.requests_per_minute),
                      "x-ratelimit-remaining-requests": str(max(0, left)),
                      "x-ratelimit-reset-requests": duration(verdict.requests_reset_s)})
    audio = request.path in AUDIO_PATHS
    daily = lim.audio_seconds_per_day if audio else lim.tokens_per_day
    if daily is not None:
        name = "audio-seconds" if audio else "tokens"
        found.update({f"x-ratelimit-limit-{name}": f"{daily:g}",
                      f"x-ratelimit-remaining-{name}": f"{max(0.0, daily - verdict.used_today):g}",
                      f"x-ratelimit-reset-{name}": duration(usage.seconds_to_midnight())})
    return found


def share_meta() -> dict:
    """What a job of the current request carries to the worker of its key's fair-share weight (jobs/limits.py
    `share`): {"share": weight}, or nothing where the key has the default (1)."""
    found = getattr(g, "mlxq_limit", None)
    share = found[0].limits.share if found else None
    return {} if share is None else {"share": share}


def admit_async(svc: Services, owner: str, job_id: str) -> None:
    """Count an async job against its key's `queued` limit, or raise the 429."""
    verdict = limits.admit_queued(svc.redis, svc.key_limits, owner, job_id, svc.settings.result_ttl_s)
    if verdict.refused:
        raise _refusal(verdict)


def register_rate_limits(app: Flask) -> None:
    """Check every request that starts work against its key's limits (after auth); add the headers after it."""

    @app.before_request
    def _check():
        if request.method != "POST" or request.path not in WORK_PATHS:
            return
        who = caller()
        if who.admin:
            return
        svc, token = services(), uuid.uuid4().hex
        synchronous = not request.path.startswith(ASYNC_PREFIX)
        verdict = limits.admit(svc.redis, svc.key_limits, who.owner, token, synchronous=synchronous,
                               daily=limits.AUDIO if request.path in AUDIO_PATHS else limits.TOKENS)
        if verdict.refused:
            raise _refusal(verdict)
        if verdict.limits.any():
            g.mlxq_limit = (verdict, token if synchronous and verdict.limits.concurrent is not None else None)

    @app.after_request
    def _headers(response):
        found = getattr(g, "mlxq_limit", None)
        if found is None:
            return response
        verdict, token = found
        response.headers.update(headers(verdict))
        if token is not None:  # in flight until the answer (a stream: its last byte) has gone out
            svc, owner = services(), caller().owner
            response.call_on_close(lambda: limits.release(svc.redis, owner, token))
        return response
