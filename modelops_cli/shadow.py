"""``modelops shadow``: copy a share of a model's live requests to a version that serves no
traffic, compare its answers with the ones clients got (start, status), end it with a report
(stop). docs/rollouts.md, "Shadow traffic"."""

from __future__ import annotations

import typer
from rich.table import Table

from modelops.errors import ModelopsError
from modelops.registry import Registry
from modelops_cli.app import app
from modelops_cli.output import (complete_models, console, examples, fail, json_option, load_settings, print_json,
                                 print_table)

shadow_app = typer.Typer(help="Shadow traffic: a version gets copies of live requests; answers compared, "
                              "never served.", no_args_is_help=True)
app.add_typer(shadow_app, name="shadow")


def _router(settings):
    from tasks import backends

    return backends.router(settings)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


@shadow_app.command("start", epilog=examples("modelops shadow start smollm2 2 --percent 10"))
def shadow_start(model_id: str = typer.Argument(..., help="the model", autocompletion=complete_models),
                 version: str = typer.Argument(..., help="the version that gets the copies: serving, weight 0, "
                                               "the default version's I/O schema"),
                 percent: int = typer.Option(10, help="share of the model's unpinned OpenAI requests copied (1..100)"),
                 as_json: bool = json_option("print JSON")) -> None:
    """Copy PERCENT % of MODEL's unpinned OpenAI requests to VERSION. Clients get the answers of
    the version that serves them, as before; each copy is sent by the instance that answered,
    after answering, and compared with its answer: greedy chat and completions by text (and the
    first token that differs), embeddings by cosine, every request by latency. Announce the
    version with `strategy: versioned` to have it serve nothing until promoted."""
    from tasks.traffic.shadow import start_shadow

    settings = load_settings()
    registry = Registry(settings.registry)
    if settings.router != "haproxy":
        console.print("[yellow]note:[/] on the Gateway API router copies are mirrored by the gateway (HTTPRoute "
                      "RequestMirror), which discards their answers: only the shadow's own metrics compare")
    try:
        row = start_shadow(registry, _router(settings), model_id, version, percent)
    except ValueError as e:
        fail(str(e), 2)
    except ModelopsError as e:
        fail(str(e), 1)
    if as_json:
        print_json({"model_id": model_id, "version": version, "percent": percent, "id": row.id})
        return
    console.print(f"shadow of {model_id}: {percent} % of its unpinned requests are copied to version {version}; "
                  f"`modelops shadow status {model_id}` compares, `modelops shadow stop {model_id}` ends it")


@shadow_app.command("status", epilog=examples("modelops shadow status", "modelops shadow status smollm2 --json"))
def shadow_status(model_id: str | None = typer.Argument(None, help="one model (default: every shadow running)",
                                                        autocompletion=complete_models),
                  as_json: bool = json_option("print JSON")) -> None:
    """Each running shadow's comparison since it started: copies compared, failed by the shadow
    and dropped (too many in flight), greedy answers equal, the lowest embedding cosine, and the
    two sides' latency p50/p90 (whole request)."""
    from tasks.traffic.shadow import compare_shadow

    settings = load_settings()
    registry = Registry(settings.registry)
    if model_id is not None and not registry.versions(model_id):
        fail(f"unknown model {model_id!r} (`modelops status` lists the models)", 2)
    running = registry.shadows(model_id)
    if model_id is not None and not running:
        fail(f"no shadow runs on {model_id} (`modelops shadow start {model_id} VERSION` starts one)", 2)
    report = [{"model_id": s.model_id, "version": s.version, "percent": s.percent, "origin": s.origin,
               "started_at": f"{s.started_at:%Y-%m-%dT%H:%M:%S}Z", **compare_shadow(registry, s).as_dict()}
              for s in running]
    if as_json:
        print_json(report)
        return
    if not report:
        console.print("no shadow runs (`modelops shadow start MODEL VERSION --percent 10`)")
        return
    table = Table("model", "shadow", "share", "compared", "shadow failed", "dropped", "greedy equal",
                  "cosine min", "latency p50 served → shadow", "p90 served → shadow")
    for r in report:
        lat = r["latency_s"]
        table.add_row(r["model_id"], r["version"], f"{r['percent']} %", str(r["compared"]), str(r["shadow_failed"]),
                      str(r["dropped"]), f"{r['equal']}/{r['greedy']} ({_rate(r['equal_rate'])})",
                      "-" if r["cosine_min"] is None else f"{r['cosine_min']:.6f}",
                      f"{_ms(lat['primary']['p50'])} → {_ms(lat['shadow']['p50'])}",
                      f"{_ms(lat['primary']['p90'])} → {_ms(lat['shadow']['p90'])}")
    print_table(table)


@shadow_app.command("stop", epilog=examples("modelops shadow stop smollm2"))
def shadow_stop(model_id: str = typer.Argument(..., help="the model", autocompletion=complete_models),
                as_json: bool = json_option("print JSON")) -> None:
    """End the shadow on MODEL (copies in flight finish) and publish its comparison as the
    Prefect artifact shadow-MODEL."""
    from tasks.traffic.shadow import compare_shadow, publish_shadow_report, stop_shadow

    settings = load_settings()
    registry = Registry(settings.registry)
    try:
        row = stop_shadow(registry, _router(settings), model_id)
    except ValueError as e:
        fail(str(e), 2)
    except KeyError as e:
        fail(str(e.args[0]), 2)
    except ModelopsError as e:
        fail(str(e), 1)
    stats = compare_shadow(registry, row)
    published = publish_shadow_report(row, stats)
    if as_json:
        print_json({"model_id": model_id, "version": row.version, "artifact": published, **stats.as_dict()})
        return
    console.print(f"shadow of {model_id} on version {row.version} stopped: {stats.compared} compared, "
                  f"{stats.shadow_failed} failed by the shadow, greedy equal {_rate(stats.equal_rate)}" +
                  (f"; report: Prefect artifact {published}" if published else ""))
