"""``modelops keys``: tenants' API keys (create, ls, revoke, rotate), checked by the router.

A key is shown once, when it is created or rotated; the registry keeps its SHA-256 only
(:mod:`modelops.tenancy`). Each change reaches a running router at once: the local HAProxy's maps
are replaced through its runtime API, without a reload and without touching requests in flight;
on Kubernetes (``MODELOPS_ROUTER=gateway-api``) the key itself goes into a Secret that Envoy
Gateway reads (:meth:`~tasks.traffic.interface.Router.put_key`, before the registry stores its
hash) and each model's policies are applied again (docs/kubernetes.md).
"""

from __future__ import annotations

from datetime import UTC, datetime

import typer
from rich.table import Table

from modelops.errors import ModelopsError
from modelops.registry import ApiKey, Registry, revoked_key_refusal
from modelops.settings import Settings
from modelops.tenancy import ALL_MODELS, PLATFORM_KEY, KeyGrant, check_grant, key_hash, new_key
from modelops_cli.app import app
from modelops_cli.output import console, err, examples, fail, json_option, load_settings, print_json, print_table

MAX_USAGE_MINUTES = 10 * 366 * 24 * 60  # ten years: the registry's buckets are integer seconds

keys_app = typer.Typer(help="API keys: who may call which model, and how much (checked by the router).",
                       no_args_is_help=True)
app.add_typer(keys_app, name="keys")


def _router(settings: Settings):
    from tasks import backends

    return backends.router(settings)


def _put_key(router, name: str, key: str) -> None:
    """Give the router the key in clear (a no-op for HAProxy), before the registry stores anything."""
    try:
        router.put_key(name, key)
    except ModelopsError as e:
        fail(f"the router could not store key {name!r}, so nothing was stored: {e}", 1)


def _apply(settings: Settings, registry: Registry, router=None, *, must: bool = False) -> str:
    """Bring a running router up to the registry's keys; what happened, for the user. ``must``
    (revoke): a router that refuses the change is an error, since the key may still be admitted."""
    from tasks.traffic.interface import commit_routes

    router = router or _router(settings)
    if not router.is_running():
        return "the router is not running; it checks keys from its next start (modelops up)"
    try:
        commit_routes(registry, router)
    except ModelopsError as e:
        if must:
            fail(f"stored in the registry, but the router did not take the change, so it may still admit the key: "
                 f"{e}; run the command again once the router is fixed", 1)
        return f"the router did not take the change yet ({e}); it does at its next change"
    return "the router checks it now"


def _row(k: ApiKey) -> dict:
    return {"name": k.name, "models": list(k.models), "rpm": k.rpm, "tpm": k.tpm, "max_concurrency": k.max_concurrency,
            "throttled_until": k.throttled_until or None,
            "state": "revoked" if k.revoked_at else "active", "created_at": _utc(k.created_at),
            "rotated_at": _utc(k.rotated_at) if k.rotated_at else None,
            "revoked_at": _utc(k.revoked_at) if k.revoked_at else None}


def _utc(at: datetime) -> str:
    """ISO 8601 in UTC, whether the registry gave the time back with its zone or (SQLite) without."""
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).isoformat(timespec="seconds")


def _show_once(key: str, row: ApiKey, what: str, applied: str, as_json: bool) -> None:
    if as_json:
        print_json({**_row(row), "key": key})
        return
    console.print(key)
    err.print(f"{what} key {row.name!r} for {', '.join(row.models)}; {applied}. This is the only time the key is "
              "shown: store it now. Clients send it as the header Authorization: Bearer <key>.")


@keys_app.command("create", epilog=examples(
    "modelops keys create --name team-a --models smollm2,all-minilm-l6-v2 --rpm 600 --tpm 200000 "
    "--max-concurrency 8",
    f"modelops keys create --name ops --models '{ALL_MODELS}'"))
def keys_create(
    name: str = typer.Option(..., "--name", help="the tenant's name (lowercase letters, digits, '-'); in metrics"),
    models: str = typer.Option(..., "--models", help=f"comma-separated model ids the key may call, or '{ALL_MODELS}'"),
    rpm: int = typer.Option(None, "--rpm", help="requests per minute (a sliding minute locally, a per-minute "
                            "bucket per Envoy replica on Kubernetes); default no limit"),
    tpm: int = typer.Option(None, "--tpm", help="prompt + completion tokens per minute (counted as answers end; "
                            "the local router only); default no limit"),
    max_concurrency: int = typer.Option(None, "--max-concurrency", help="requests in flight; default no limit "
                                        "(the local router only: refused with MODELOPS_ROUTER=gateway-api)"),
    as_json: bool = json_option("print JSON, the key in its \"key\" field"),
) -> None:
    """Create an API key and print it (once: the registry keeps only its hash; on Kubernetes the
    Gateway's Secret holds the key itself).

    The first key turns keys on at the router (MODELOPS_ROUTER_AUTH=auto): from then on every
    request needs one.
    """
    settings = load_settings()
    try:
        scope = check_grant(name, models.split(","), rpm=rpm, max_concurrency=max_concurrency, tpm=tpm)
    except ValueError as e:
        fail(str(e), 2)
    registry = Registry(settings.registry)
    router = _router(settings)
    if taken := registry.key_name_taken(name):  # before the router stores a key under that name
        fail(taken, 2)
    try:
        router.check_new_key(KeyGrant(name, "", scope, rpm=rpm, max_concurrency=max_concurrency, tpm=tpm),
                             registry.grants())
    except ValueError as e:
        fail(str(e), 2)
    key = new_key()
    _put_key(router, name, key)
    try:
        row = registry.create_key(name, key_hash(key), scope, rpm=rpm, max_concurrency=max_concurrency, tpm=tpm)
    except ValueError as e:
        fail(str(e), 2)
    announced = {v.model_id for v in registry.versions()}
    if unknown := [m for m in scope if m != ALL_MODELS and m not in announced]:
        err.print(f"note: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not announced here; the key "
                  "covers it once announced (a typo in --models would do the same: `modelops status` lists models)")
    _show_once(key, row, "created", _apply(settings, registry, router), as_json)


@keys_app.command("ls", epilog=examples("modelops keys ls", "modelops keys ls --json"))
def keys_ls(as_json: bool = json_option("print JSON")) -> None:
    """List the keys (never the keys themselves): scope, limits, state."""
    rows = [_row(k) for k in Registry(load_settings().registry).api_keys()]
    if as_json:
        print_json(rows)
        return
    if not rows:
        console.print("no API keys: the router takes requests without one (`modelops keys create` makes the first)")
        return
    table = Table("name", "models", "rpm", "tpm", "max concurrency", "state", "created", "rotated")
    for r in rows:
        table.add_row(r["name"], ",".join(r["models"]), str(r["rpm"] or "-"), str(r["tpm"] or "-"),
                      str(r["max_concurrency"] or "-"),
                      r["state"] + (f" {r['revoked_at']}" if r["revoked_at"] else ""), r["created_at"],
                      r["rotated_at"] or "-")
    print_table(table)


@keys_app.command("revoke", epilog=examples("modelops keys revoke team-a"))
def keys_revoke(name: str = typer.Argument(..., help="the key's name"),
                as_json: bool = json_option("print JSON")) -> None:
    """Revoke a key: its next request is a 401; requests in flight finish."""
    settings = load_settings()
    registry = Registry(settings.registry)
    before = next((k for k in registry.api_keys() if k.name == name), None)
    try:
        row = registry.revoke_key(name)
    except KeyError as e:
        fail(e.args[0], 2)
    applied = _apply(settings, registry, must=True)
    if as_json:
        print_json(_row(row))
        return
    if before is not None and before.revoked_at is not None:
        console.print(f"key {name!r} was already revoked at {_utc(before.revoked_at)}; {applied}")
        return
    console.print(f"revoked key {name!r}; {applied}")


@keys_app.command("rotate", epilog=examples("modelops keys rotate team-a"))
def keys_rotate(name: str = typer.Argument(..., help="the key's name"), as_json: bool = json_option(
        "print JSON, the new key in its \"key\" field")) -> None:
    """Give a key a new secret and print it (once); the old secret stops working at once (on
    Kubernetes, once Envoy Gateway has read the key's new Secret). Scope and limits stay."""
    settings = load_settings()
    registry = Registry(settings.registry)
    router = _router(settings)
    known = {k.name: k for k in registry.api_keys()}
    if name not in known:  # checked before the router stores a new secret under that name
        fail(f"no key named {name!r} (`modelops keys ls` lists them)", 2)
    if known[name].revoked_at is not None:
        fail(revoked_key_refusal(name), 2)
    key = new_key()
    _put_key(router, name, key)
    try:
        row = registry.rotate_key(name, key_hash(key))
    except (KeyError, ValueError) as e:
        fail(e.args[0], 2)
    _show_once(key, row, "rotated", _apply(settings, registry, router), as_json)


@keys_app.command("usage", epilog=examples("modelops keys usage", "modelops keys usage team-a --minutes 1440 --json"))
def keys_usage(
    name: str = typer.Argument(None, help="one key (default: every key)"),
    minutes: float = typer.Option(60, "--minutes", min=0.1, max=MAX_USAGE_MINUTES, help="how far back"),
    as_json: bool = json_option("print JSON"),
) -> None:
    """Requests and tokens per key and model, as the instances counted them (10 s buckets,
    recorded by the autoscaler daemon that `modelops up` starts)."""
    import time

    registry = Registry(load_settings().registry)
    if name is not None and name != PLATFORM_KEY and name not in {k.name for k in registry.api_keys()}:
        fail(f"no key named {name!r} (`modelops keys ls` lists them)", 2)
    rows = registry.usage(time.time() - minutes * 60, key_name=name)
    if as_json:
        print_json(rows)
        return
    if not rows:
        console.print(f"no usage in the last {minutes:g} min" + (f" for key {name!r}" if name else ""))
        return
    table = Table("key", "model", "requests", "prompt tokens", "completion tokens")
    for r in rows:
        who = r["key"] + (" (the platform's route checks)" if r["key"] == PLATFORM_KEY else "")
        table.add_row(who, r["model_id"], str(r["requests"]), str(r["prompt_tokens"]), str(r["completion_tokens"]))
    print_table(table)
