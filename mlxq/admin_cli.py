"""`mlxq admin ...`: the admin API from the shell (workers, queues, load / unload / pin / unpin a model, each
key's usage and limits)."""

from __future__ import annotations

import json

import click

from mlxq.client import ADMIN_KEY_HINT, DEFAULT_URL, connect

URL = click.option("--url", envvar="MLXQ_URL", default=DEFAULT_URL, show_default=True,
                   help="The mlxq server (env MLXQ_URL).")
KEY = click.option("--admin-key", envvar="MLXQ_ADMIN_KEY", default=None,
                   help="The admin key (env MLXQ_ADMIN_KEY); not needed on an open server.")


@click.group()
def admin():
    """Operate a running mlxq: see workers and queues, load, unload or pin models."""


def _call(url: str, key: str | None, path: str, body: dict | None = None, method: str | None = None,
          params: dict | None = None) -> dict:
    """GET `path` (POST `body` as JSON when given, or `method`) on the admin API; the decoded answer."""
    with connect(url, key, ADMIN_KEY_HINT) as client:
        method = method or ("GET" if body is None else "POST")
        return client.request(method, path, json=body, params=params).json()


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


USAGE_COLUMNS = (("requests", "requests"), ("prompt_tokens", "prompt"), ("completion_tokens", "completion"),
                 ("cached_tokens", "cached"), ("audio_seconds", "audio s"), ("images", "images"),
                 ("embedding_inputs", "embedded"))


@admin.command()
@click.option("--start", default=None, help="First UTC day, YYYY-MM-DD (default: --end).")
@click.option("--end", default=None, help="Last UTC day, YYYY-MM-DD (default: today).")
@click.option("--key", default=None, help="One key: its id, or the key itself.")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON rows.")
@URL
@KEY
def usage(start, end, key, as_json, url, admin_key):
    """What each key used, per UTC day and model (model * : the key's day total)."""
    params = {name: value for name, value in (("start", start), ("end", end), ("key", key)) if value}
    rows = _call(url, admin_key, "/v1/admin/usage", params=params)["data"]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no usage in that range")
        return
    click.echo(f"{'day':10}  {'key':24}  {'model':24}" + "".join(f"  {title:>10}" for _, title in USAGE_COLUMNS))
    for row in rows:
        click.echo(f"{row['day']:10}  {row['key']:24}  {row['model'][:24]:24}"
                   + "".join(f"  {row.get(name, 0):>10g}" for name, _ in USAGE_COLUMNS))


@admin.command()
@click.argument("key", required=False)
@click.option("--set", "settings", multiple=True, metavar="NAME=VALUE",
              help="Set KEY's limits (a NAME left out is no limit; VALUE none: no limit), e.g. "
                   "--set requests_per_minute=60 --set tokens_per_day=1000000.")
@click.option("--clear", is_flag=True, help="Remove KEY's admin API limits (the file's apply again).")
@URL
@KEY
def limits(key, settings, clear, url, admin_key):
    """Per-key limits and fair-share weight (share): all entries, or what applies to KEY (its id, the key itself, or
    default)."""
    if key is None:
        if settings or clear:
            raise click.UsageError("--set and --clear need a KEY")
        click.echo(json.dumps(_call(url, admin_key, "/v1/admin/limits"), indent=2))
        return
    if settings and clear:
        raise click.UsageError("--set and --clear do not go together")
    path = f"/v1/admin/limits/{key}"
    if clear:
        answer = _call(url, admin_key, path, method="DELETE")
    elif settings:
        body = {}
        for item in settings:
            name, sep, value = item.partition("=")
            if not sep:
                raise click.UsageError(f"--set {item!r}: write NAME=VALUE")
            body[name.strip()] = None if value.strip().lower() in ("", "none", "null") else float(value)
        body = {n: (int(v) if v is not None and n not in ("audio_seconds_per_day", "share") else v)
                for n, v in body.items()}
        answer = _call(url, admin_key, path, body, method="PUT")
    else:
        answer = _call(url, admin_key, path)
    click.echo(json.dumps(answer, indent=2))
