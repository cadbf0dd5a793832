"""The CLI's HTTP client: httpx (and httpx-sse for event streams) to a running mlxq.

Whatever goes wrong becomes one `Error: ...` line that says what happened: the server's own answer
(its status and the message of its error envelope) or why it could not be reached, with a hint.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click
import httpx
from httpx_sse import connect_sse

DEFAULT_URL = "http://127.0.0.1:8000"

TIMEOUT = httpx.Timeout(600.0, connect=10.0)
"""Connecting fails fast; an answer may take long (a prefill, a long upload being transcribed)."""

API_KEY_HINT = "Pass the key with --api-key or set MLXQ_API_KEY."
ADMIN_KEY_HINT = "Pass the admin key with --admin-key or set MLXQ_ADMIN_KEY."


def error_text(body: dict) -> str:
    """The message of an error envelope (`{"error": {"message", "code"}}`), with its code."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return str(body)[:500]
    code = error.get("code")
    return f"{error.get('message') or 'the request failed'}" + (f" ({code})" if code else "")


def _refusal(response: httpx.Response, key_hint: str) -> click.ClickException:
    """The exception for an answer of 400 or more: its status and the server's message as they are."""
    try:
        text = error_text(response.json())
    except ValueError:  # not JSON: a proxy's page, say
        text = response.text.strip()[:500] or response.reason_phrase
    line = f"HTTP {response.status_code}: {text}"
    if response.headers.get("Retry-After"):
        line += f"; retry after {response.headers['Retry-After']} s"
    if response.status_code == 401:
        line += f"\n{key_hint}"
    return click.ClickException(line)


@contextmanager
def connect(url: str, key: str | None, key_hint: str = API_KEY_HINT) -> Iterator[httpx.Client]:
    """An httpx client on the mlxq at `url`: a refusal raises a ClickException carrying the server's
    answer; an unreachable server, one naming the cause and what to check."""

    def check(response: httpx.Response) -> None:
        if response.status_code >= 400:
            response.read()  # a streamed answer's body is not read yet
            raise _refusal(response, key_hint)

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT,
                          event_hooks={"response": [check]}) as client:
            yield client
    except httpx.ConnectError as exc:
        raise click.ClickException(f"cannot reach {url}: {_reason(exc)}. Is `mlxq up` running there? Point "
                                   "--url (or MLXQ_URL) at the server.") from None
    except httpx.TimeoutException as exc:
        raise click.ClickException(f"{url} did not answer in time ({type(exc).__name__}).") from None
    except httpx.RemoteProtocolError as exc:
        raise click.ClickException(f"{url} closed the connection without a complete answer: {exc}") from None
    except httpx.HTTPError as exc:
        raise click.ClickException(f"talking to {url} failed: {exc}") from None


def _reason(exc: httpx.ConnectError) -> str:
    """'connection refused' for a refused connection, else the error's own words."""
    text = str(exc)
    return "connection refused" if "refused" in text.lower() else text


def sse(client: httpx.Client, method: str, path: str, **kwargs) -> Iterator[tuple[str, dict]]:
    """(event name, JSON data) of each event of a Server-Sent Events answer; OpenAI's `[DONE]` ends it."""
    with connect_sse(client, method, path, **kwargs) as source:
        for event in source.iter_sse():
            if event.data == "[DONE]":
                return
            if event.data:
                yield event.event, event.json()
