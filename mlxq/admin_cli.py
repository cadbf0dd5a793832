"""`mlxq admin ...`: the admin API from the shell (workers, queues, load / unload / pin / unpin a model)."""

from __future__ import annotations

import click

from mlxq.client import ADMIN_KEY_HINT, DEFAULT_URL, connect

URL = click.option("--url", envvar="MLXQ_URL", default=DEFAULT_URL, show_default=True,
                   help="The mlxq server (env MLXQ_URL).")
KEY = click.option("--admin-key", envvar="MLXQ_ADMIN_KEY", default=None,
                   help="The admin key (env MLXQ_ADMIN_KEY); not needed on an open server.")


@click.group()
def admin():
    """Operate a running mlxq: see workers and queues, load, unload or pin models."""


def _call(url: str, key: str | None, path: str, body: dict | None = None) -> dict:
    """GET `path` (POST `body` as JSON when given) on the admin API; the decoded answer."""
    with connect(url, key, ADMIN_KEY_HINT) as client:
        response = client.get(path) if body is None else client.post(path, json=body)
        return response.json()


@admin.command()
@URL
@KEY
def workers(url, admin_key):
    """Live workers: device, memory, resident models (* pinned), jobs in hand."""
    for w in _call(url, admin_key, "/v1/admin/workers")["data"]:
        memory = w.get("memory") or {}  # a worker of an older version does not say
        rss = (f"  RSS {memory['rss_bytes'] / 2**20:.0f} MiB (peak {memory['rss_peak_bytes'] / 2**20:.0f})"
               if memory else "")
        click.echo(f"{w['name']}  {w.get('device')}  {w['used_bytes'] / 2**20:.0f}/{w['budget_bytes'] / 2**20:.0f} MiB"
                   f"{rss}  jobs: {len(w.get('jobs', []))}")
        for m in w.get("models", []):
            click.echo(f"  {'*' if m.get('pinned') else ' '} {m['id']}  {m['bytes'] / 2**20:.0f} MiB")


@admin.command()
@URL
@KEY
def queues(url, admin_key):
    """Each queue's depth and the age of its oldest job."""
    for q in _call(url, admin_key, "/v1/admin/queues")["data"]:
        click.echo(f"{q['queue']:12} {q['depth']:6d} waiting, oldest {q['oldest_age_s']:.1f}s")


def _action(name: str):
    @admin.command(name, help=f"{name.capitalize()} MODEL in the worker (answered once it is done).")
    @click.argument("model")
    @URL
    @KEY
    def command(model, url, admin_key):
        result = _call(url, admin_key, f"/v1/admin/models/{name}", {"model": model})
        state = "done" if result["changed"] else "nothing to do"
        click.echo(f"{name} {result['model']}: {state}; resident: "
                   + (", ".join(m["id"] + ("*" if m.get("pinned") else "") for m in result["resident"]) or "none"))

    return command


for _name in ("load", "unload", "pin", "unpin"):
    _action(_name)
