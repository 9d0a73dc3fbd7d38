"""``modelops experiment``: split a model's live requests between versions by a stable hash of a
client key (start), compare the arms (status), end keeping one (stop). docs/rollouts.md."""

from __future__ import annotations

import typer
from rich.table import Table

from modelops.errors import ModelopsError
from modelops.experiments import MAX_KEY_BYTES, ExperimentSpec, parse_arms, parse_key
from modelops.registry import Registry
from modelops_cli.app import app
from modelops_cli.output import (complete_models, console, examples, fail, json_option, load_settings, print_json,
                                 print_table)

experiment_app = typer.Typer(help="A/B experiments: sticky arms by a hash of a client key, compared, one kept.",
                             no_args_is_help=True)
app.add_typer(experiment_app, name="experiment")


def _router(settings):
    from tasks import backends

    return backends.router(settings)


@experiment_app.command("start", epilog=examples("modelops experiment start smollm2 --arms 1:50,2:50 --key user",
                                                 "modelops experiment start smollm2 --arms 1:90,2:10 --key "
                                                 "header:X-User-Id --default 1"))
def experiment_start(
    model_id: str = typer.Argument(..., help="the model", autocompletion=complete_models),
    arms: str = typer.Option(..., help="VERSION:PERCENT,...: serving versions whose shares sum to 100"),
    key: str = typer.Option("user", help="what a request is assigned by: `user` (the request body's user "
                            "field) or `header:<Name>`"),
    default: str | None = typer.Option(None, help="the arm of requests without the key (default: the first arm)"),
    as_json: bool = json_option("print JSON"),
) -> None:
    """Split MODEL's unpinned OpenAI requests between its serving versions: each request goes to
    the arm whose share holds crc32(key) mod 100, so a user always gets the same arm whatever
    the instance counts. Requests without the key, or with one over 256 bytes, go to the
    default arm (counted as such); requests pinned with X-Model-Version go where they name.
    Rollouts, promote and rollback of the model wait until the experiment stops."""
    from tasks.traffic.experiment import start_experiment

    settings = load_settings()
    registry = Registry(settings.registry)
    if not registry.versions(model_id):
        fail(f"model {model_id!r} is not in the registry (`modelops status` lists the models)", 2)
    serving = {v.version for v in registry.versions(model_id) if v.state == "serving"}
    try:
        parsed = parse_arms(arms, serving)
        source = parse_key(key)
    except ValueError as e:
        fail(str(e), 2)
    default = default or parsed[0].version
    if default not in {a.version for a in parsed}:
        fail(f"--default: {default!r} is not one of the arms ({', '.join(a.version for a in parsed)})", 2)
    spec = ExperimentSpec(parsed, source, default)
    try:
        row = start_experiment(registry, _router(settings), model_id, spec)
    except ValueError as e:
        fail(str(e), 2)
    except ModelopsError as e:
        fail(str(e), 1)
    if as_json:
        print_json({"model_id": model_id, "arms": {a.version: a.percent for a in parsed}, "key": source,
                    "default": default, "started_at": row.started_at})
        return
    console.print(f"experiment on {model_id}: " + ", ".join(f"version {a.version} {a.percent} %" for a in parsed) +
                  f", by {source}; requests without it (or with one over {MAX_KEY_BYTES} bytes) go to {default}")


@experiment_app.command("status", epilog=examples("modelops experiment status", "modelops experiment status smollm2 "
                                                  "--json"))
def experiment_status(model_id: str | None = typer.Argument(None, help="one model (default: every experiment "
                                                            "running)", autocompletion=complete_models),
                      as_json: bool = json_option("print JSON")) -> None:
    """Compare each running experiment's arms since it started: requests the router sent each
    (by key, to the default arm), the version's answered and failed requests with a 95 %
    interval of its error rate, and 95 % intervals of TTFT p50/p90 and inter-token latency
    p90 (from the version's instances' histograms)."""
    from tasks.traffic.experiment import compare_arms, router_metrics_text

    settings = load_settings()
    registry = Registry(settings.registry)
    running = registry.experiments(model_id)
    if model_id is not None and not running:
        fail(f"no experiment runs on {model_id}", 2)
    metrics = router_metrics_text(settings)
    report = [{"model_id": e.model_id, "key": e.key, "default": e.default_version,
               "started_at": f"{e.started_at:%Y-%m-%dT%H:%M:%S}Z",
               "arms": [s.__dict__ for s in compare_arms(registry, e, metrics)]} for e in running]
    if as_json:
        print_json(report)
        return
    if not report:
        console.print("no experiment runs (`modelops experiment start MODEL --arms 1:50,2:50`)")
        return

    def ci(x, scale: float = 1000.0, unit: str = " ms") -> str:
        return "-" if x is None else f"{x[1] * scale:.1f} [{x[0] * scale:.1f}, {x[2] * scale:.1f}]{unit}"

    for e in report:
        console.print(f"{e['model_id']}: by {e['key']}, default {e['default']}, since {e['started_at']}")
        table = Table("arm", "share", "by key", "to default", "answered", "failed", "error rate (95 %)",
                      "TTFT p50", "TTFT p90", "ITL p90", "tokens in / out")
        for a in e["arms"]:
            table.add_row(a["version"], f"{a['percent']} %", str(a["by_key"]), str(a["by_default"]), str(a["answered"]),
                          str(a["failed"]), ci(a["error_rate"], 100, " %"), ci(a["ttft_p50"]), ci(a["ttft_p90"]),
                          ci(a["itl_p90"]), f"{a['prompt_tokens']} / {a['generation_tokens']}")
        print_table(table)


@experiment_app.command("stop", epilog=examples("modelops experiment stop smollm2 --keep 2"))
def experiment_stop(model_id: str = typer.Argument(..., help="the model", autocompletion=complete_models),
                    keep: str = typer.Option(..., help="the arm that stays: it becomes the default (weight 100)"),
                    as_json: bool = json_option("print JSON")) -> None:
    """End the experiment on MODEL keeping one arm: it becomes the default; the other arms keep
    serving requests pinned to them until cleanup retires them. The arms' comparison until then
    is published as the Prefect artifact experiment-MODEL."""
    from modelops_cli.models import promoted_text
    from tasks.traffic.experiment import compare_arms, publish_experiment_report, router_metrics_text, stop_experiment

    settings = load_settings()
    registry = Registry(settings.registry)
    running = registry.experiment(model_id)
    # Measured before the arms change: the losing ones drain from here on.
    arms = compare_arms(registry, running, router_metrics_text(settings)) if running else []
    try:
        row, promoted = stop_experiment(registry, _router(settings), model_id, keep)
    except (KeyError, ValueError) as e:
        fail(str(e.args[0]), 2)
    except ModelopsError as e:
        fail(str(e), 1)
    published = publish_experiment_report(row, arms)
    if as_json:
        print_json({"model_id": model_id, "kept": keep, "promoted": promoted, "artifact": published,
                    "arms": [a.__dict__ for a in arms]})
        return
    console.print(f"experiment on {model_id} stopped; the other arms drain (pinned requests only) until cleanup "
                  "retires them" + (f"; comparison: Prefect artifact {published}" if published else ""))
    console.print(promoted_text(model_id, promoted) if promoted else f"{model_id}: {keep} was the default already")
