"""The ``modelops`` command line (typer + rich).

The CLI is the top of the dependency graph: commands that run flows or talk to Prefect import
them lazily, so ``modelops status`` stays fast and the core never imports Prefect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from modelops.errors import ModelopsError
from modelops.manifest import Manifest, load_manifest
from modelops.registry import Registry
from modelops.settings import Settings, get_settings

__all__ = ["app"]

app = typer.Typer(help="Announce model versions and serve them on vLLM + Triton.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
stack_app = typer.Typer(help="Start and stop the local stack (the same as `modelops up` / `modelops down`).",
                        no_args_is_help=True)
image_app = typer.Typer(help="The pinned runtime image.", no_args_is_help=True)
cache_app = typer.Typer(help="The model cache on FSx (materialized weights).", no_args_is_help=True)
app.add_typer(stack_app, name="stack", hidden=True)  # kept for scripts written before `up`/`down`
app.add_typer(image_app, name="image")
app.add_typer(cache_app, name="cache")
# Messages carry user data (regexes, URLs): no markup parsing, and no wrapping, so URLs and
# ids stay copyable even when output is piped (rich assumes 80 columns there).
console = Console(soft_wrap=True, markup=False, highlight=False)
err = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)

EVENT = "modelops.model.announced"


def _examples(*lines: str) -> str:
    """An epilog for ``--help``: one example command per paragraph."""
    return "Examples:\n\n" + "\n\n".join(f"  {x}" for x in lines)


def _complete_models(incomplete: str) -> list[str]:
    """Shell completion of model ids from the registry."""
    try:
        return sorted({v.model_id for v in Registry(get_settings().registry).versions()
                       if v.model_id.startswith(incomplete)})
    except Exception:
        return []


def _print_json(data) -> None:
    print(json.dumps(data, indent=2, default=str))


def _settings() -> Settings:
    """Settings, or a one-line error naming the bad environment variable."""
    from pydantic import ValidationError

    try:
        return get_settings()
    except ValidationError as e:
        bad = [f"MODELOPS_{'_'.join(map(str, x['loc'])).upper()}: {x['msg']} (got {x.get('input')!r})"
               for x in e.errors()]
        _fail("invalid setting: " + "; ".join(bad), 2)
        raise  # unreachable: _fail exits


def _print_table(table: Table) -> None:
    # Piped output gets 80 columns from rich; tables of URLs and paths need more to stay whole.
    (console if console.is_terminal else Console(width=240)).print(table)


_json_mode = False  # set by --json (one command per process): _fail answers scripts in JSON too


def _remember_json(value: bool) -> bool:
    global _json_mode
    _json_mode = _json_mode or bool(value)
    return value


def _json_option(help: str):
    """The ``--json`` option of every command that has one."""
    return typer.Option(False, "--json", help=help, callback=_remember_json)


def _fail(message: str, code: int = 1) -> None:
    """Exit ``code`` after saying what failed: on stderr, and under ``--json`` also as
    ``{"error": message, "exit_code": code}`` on stdout, so scripts always get one JSON document."""
    if _json_mode:
        _print_json({"error": message, "exit_code": code})
    err.print(Text("error: ", style="bold red") + Text(message))
    raise typer.Exit(code)


_prefect_source = ""  # where PREFECT_API_URL came from (set by _prefect_target), for error messages


@app.callback()
def _prefect_target() -> None:
    """Point Prefect at the local stack's server when it is up and ``PREFECT_API_URL`` is unset.

    The environment wins; then the local stack, when its server answers ``/api/health``; otherwise the server configured
    in ``.env``, ``prefect.toml``, ``pyproject.toml`` or the active profile (read as Prefect reads
    them, and exported so that every message names it). When the stack wins over a configured
    server, stderr says so, naming both and how to choose. Runs before any command imports
    Prefect: Prefect reads its settings once, at import.
    """
    import socket

    import httpx

    from modelops.stack import configured_prefect_api_url

    global _prefect_source
    if os.environ.get("PREFECT_API_URL"):
        _prefect_source = "PREFECT_API_URL in the environment"
        return
    try:
        settings = get_settings()
        with socket.create_connection(("127.0.0.1", settings.prefect_port), timeout=0.5):
            pass  # fast path: nothing listens (the usual case without a stack)
        # Something listens: the stack's Prefect server only if it answers Prefect's /health.
        if httpx.get(f"{settings.prefect_api_url}/health", timeout=2).status_code != 200:
            raise OSError("not a Prefect server")
    except (OSError, ValueError, httpx.HTTPError):
        # No local stack: the configured server if any (exported, so every message names the
        # server Prefect uses), else commands that need one say so; --local runs go ephemeral.
        if configured := configured_prefect_api_url():
            os.environ["PREFECT_API_URL"], _prefect_source = configured
        return
    os.environ["PREFECT_API_URL"], _prefect_source = settings.prefect_api_url, "the local stack"
    os.environ.setdefault("PREFECT_HOME", str(settings.home_dir / "prefect"))
    configured = configured_prefect_api_url()
    if configured and configured[0].rstrip("/") != settings.prefect_api_url.rstrip("/"):
        err.print(f"note: using the local stack's Prefect server {settings.prefect_api_url}, not {configured[0]} "
                  f"from {configured[1]}; set PREFECT_API_URL to choose")


def _flow_run_url(settings: Settings, flow_run_id: str) -> str:
    """The flow run's page in the Prefect UI of the server this CLI talks to."""
    api = os.environ.get("PREFECT_API_URL") or settings.prefect_api_url
    return f"{api.removesuffix('/').removesuffix('/api')}/runs/flow-run/{flow_run_id}"


@app.command(epilog=_examples(
    "modelops announce deployments/models/all-minilm-l6-v2.yaml --wait",
    "modelops announce my-model.yaml --json          (event id and flow run URL for scripts)",
    "modelops announce my-model.yaml --local         (in this process, no worker needed)",
    "curl -X POST http://127.0.0.1:4200/api/events -H 'Content-Type: application/json' -d @event.json"
    "   (the same event without the CLI: docs/operations.md)"))
def announce(
    manifest_file: Path = typer.Argument(..., help="model manifest (YAML)"),
    wait: bool = typer.Option(False, "--wait", help="follow the flow run to its end; non-zero exit if it failed"),
    local: bool = typer.Option(False, "--local", help="run the lifecycle flow in this process, without a worker "
                               "(always waits; instances it starts keep running until `modelops down`)"),
    timeout: float = typer.Option(1800, min=1, help="seconds --wait follows the flow run"),
    as_json: bool = _json_option("print JSON (event id, flow run id and URL, final state)"),
) -> None:
    """Announce a model version: emit the Prefect event modelops.model.announced.

    The model-lifecycle deployment's trigger starts a flow run; its URL is printed as soon as
    the run exists. The manifest is checked first: a bad one is refused (exit 2) before any event.
    """
    try:
        manifest = load_manifest(manifest_file)
        from tasks.package import preflight

        preflight(manifest)
    except ModelopsError as e:
        _fail(str(e), 2)
    settings = _settings()
    if local:
        _require_prefect(local_run=True)
        _announce_local(manifest, settings, as_json)
        return
    if os.environ.get("MODELOPS_FAIL_STAGE"):
        err.print("warning: MODELOPS_FAIL_STAGE is ignored here: the worker runs the flow with the environment "
                  "it got at `modelops up`; use --local for a failure drill")
    _require_prefect()
    from prefect.events import emit_event
    from prefect.events.clients import get_events_client
    from prefect.events.worker import EventsWorker

    event_id = uuid.uuid4()
    emit_event(event=EVENT, resource={"prefect.resource.id": f"modelops.model.{manifest.model_id}",
                                      "prefect.resource.name": manifest.model_id,
                                      "modelops.version": manifest.version},
               payload=manifest.model_dump(mode="json"), id=event_id)
    import logging

    logging.disable(logging.WARNING)  # the drain logs "Still processing items" while it flushes
    try:
        EventsWorker.drain_all()
    finally:
        logging.disable(logging.NOTSET)
    if not as_json:
        console.print(f"announced {manifest.model_id} version {manifest.version} "
                      f"(event {EVENT}, id {event_id})")
    _follow(str(event_id), settings, timeout if wait else min(timeout, 60), wait=wait, as_json=as_json,
            extra={"model_id": manifest.model_id, "version": manifest.version})


def _announce_local(manifest: Manifest, settings: Settings, as_json: bool = False) -> None:
    # The local stack's server records the run when it is up (_prefect_target), else Prefect's
    # ephemeral API does.
    from flows.lifecycle import model_lifecycle

    state = model_lifecycle(manifest, f"local-{uuid.uuid4()}", return_state=True)
    _report_state(state, as_json, {"model_id": manifest.model_id, "version": manifest.version})


def _follow(event_id: str, settings: Settings, timeout: float, wait: bool = True, as_json: bool = False,
            deployment: str = "model-lifecycle", match=None, extra: dict | None = None) -> None:
    """Find the flow run the event (or ``match(run)``) started, print its URL, and with ``wait``
    follow it to a final state (exit 1 unless it completed)."""
    import anyio
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
    )

    match = match or (lambda r: r.parameters.get("announcement_id") == event_id)
    say = (lambda msg: None) if as_json else console.print

    async def find_and_wait():
        async with get_client() as client:
            deadline = time.monotonic() + timeout
            run = None
            while run is None:
                if time.monotonic() > deadline:
                    return None, f"no flow run of {deployment} was created within {timeout:.0f} s (is the deployment "\
                                 "deployed, with its trigger, and a worker running? run `modelops up`)"
                runs = await client.read_flow_runs(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])),
                    flow_run_filter=FlowRunFilter(), limit=50,
                    sort="EXPECTED_START_TIME_DESC")
                run = next((r for r in runs if match(r)), None)
                if run is None:
                    await anyio.sleep(1)
            say(f"flow run {run.name}: {_flow_run_url(settings, str(run.id))}")
            if not wait:
                return run, None
            last = None
            while True:
                run = await client.read_flow_run(run.id)
                if run.state and run.state.name != last:
                    last = run.state.name
                    say(f"  state: {last}")
                if run.state and run.state.is_final():
                    return run, None
                if time.monotonic() > deadline:
                    return run, f"flow run still {run.state.name if run.state else '?'} after {timeout:.0f} s"
                await anyio.sleep(2)

    run, problem = anyio.run(find_and_wait)
    if as_json:
        _print_json({**(extra or {}), "event_id": event_id or None, "flow_run_id": str(run.id) if run else None,
                     "flow_run_url": _flow_run_url(settings, str(run.id)) if run else None,
                     "state": run.state.name if run and run.state else None,
                     "message": problem or (run.state.message if run and run.state else None)})
        if problem or (wait and not run.state.is_completed()):
            raise typer.Exit(1)
        return
    if problem:
        _fail(problem)
    if not wait:
        return
    if run.state.is_completed():
        console.print(Text("completed: ", style="green") + Text(run.state.message or ""))
    else:
        _fail(f"flow run {run.state.name}: {run.state.message}\n  see {_flow_run_url(settings, str(run.id))}")


@app.command(epilog=_examples("modelops status", "modelops status --json | jq '.models[].versions[] | {version, state, weight}'"))
def status(as_json: bool = _json_option("print JSON")) -> None:
    """Models, versions, states, weights and endpoints from the registry."""
    data = Registry(_settings().registry).status()
    if as_json:
        print(json.dumps(data, indent=2))
        return
    table = Table("model", "version", "state", "weight", "strategy", "instance", "OpenAI", "KServe gRPC", "reason")
    for m in data["models"]:
        for v in m["versions"]:
            instances = list(v["endpoints"].items()) or [("-", {})]
            for name, e in instances:
                inst = v.get("instances", {}).get(name, {})
                shown = name
                if inst.get("state") not in (None, "running"):
                    shown += f" ({inst['state']})"
                if inst.get("restarts"):  # its supervisor restarted it: say how often and why
                    shown += f"\nrestarted {inst['restarts']}x, last: {inst['last_exit'][:160]}"
                table.add_row(m["model_id"], v["version"], v["state"], str(v["weight"]), v["strategy"], shown,
                              e.get("openai", "-"), e.get("kserve_grpc", "-"), v["reason"] or "")
    _print_table(table)


@app.command(epilog=_examples("modelops promote all-minilm-l6-v2 2", "modelops promote all-minilm-l6-v2 2 --json"))
def promote(
    model_id: str = typer.Argument(..., help="the model", autocompletion=_complete_models),
    version: str = typer.Argument(..., help="the version to make the default for unpinned requests"),
    as_json: bool = _json_option("print JSON"),
) -> None:
    """Make a fully ready version the model's default route.

    The previous default keeps serving requests pinned with X-Model-Version until cleanup
    retires it.
    """
    from tasks.lock import rollout_lock
    from tasks.traffic.promote import promote as do_promote

    settings = _settings()
    row = Registry(settings.registry).get_version(model_id, version)
    if row is None or row.state != "serving":
        known = ", ".join(f"{v.version} ({v.state})" for v in Registry(settings.registry).versions(model_id))
        _fail(f"{model_id} {version} is {row.state if row else 'not announced'}; only a serving version can become "
              f"the default (versions: {known or 'none'}; a retired one must be announced again, or use "
              f"`modelops rollback {model_id} --to VERSION`)", 2)
    if row.weight == 100:
        _fail(f"{model_id} {version} is already the default (weight 100)", 2)
    try:
        # Not in the middle of a rollout of the same model (waits up to a minute for one to end).
        with rollout_lock(model_id, holder=f"modelops promote (pid {os.getpid()})", wait_s=60):
            result = do_promote(model_id, version)
    except ModelopsError as e:
        _fail(str(e))
    if as_json:
        _print_json(result)
        return
    console.print(f"{model_id}: default is now {result['default']} (previous: {', '.join(result['previous']) or '-'}; "
                  f"they keep serving pinned requests). Both versions have run side by side for "
                  f"{result['overlap_instance_hours']} instance-hours.")


@app.command(epilog=_examples("modelops cleanup --dry-run", "modelops cleanup --idle-after 0 --model all-minilm-l6-v2 --json"))
def cleanup(
    idle_after: float = typer.Option(600, "--idle-after", help="seconds a version must have had no traffic"),
    model_id: str = typer.Option(None, "--model", help="only this model", autocompletion=_complete_models),
    dry_run: bool = typer.Option(False, "--dry-run", help="print what would be removed, remove nothing"),
    as_json: bool = _json_option("print JSON"),
) -> None:
    """Retire idle versions (replaced, weight 0, no traffic for --idle-after seconds).

    Never the latest serving version of a model, never one with weight above 0. The
    cleanup-idle-versions deployment runs the same on a cron schedule.
    """
    from modelops.registry import Registry
    from tasks.cleanup import cleanup_idle_versions, idle_versions

    settings = _settings()
    import math

    if not math.isfinite(idle_after) or idle_after < 0:
        _fail(f"--idle-after must be a finite number of seconds ≥ 0, got {idle_after}", 2)
    if model_id is not None and not Registry(settings.registry).versions(model_id):
        _fail(f"--model {model_id}: no such model in the registry (`modelops status` lists them)", 2)
    if dry_run:
        targets = idle_versions(Registry(settings.registry), idle_after, model_id)
        if as_json:
            _print_json({"dry_run": True, "would_retire": [{"model_id": m, "version": v} for m, v in targets]})
            return
        console.print("would retire: " + (", ".join(f"{m} {v}" for m, v in targets) or "nothing"))
        return
    retired = cleanup_idle_versions(idle_after, model_id)
    if as_json:
        _print_json({"dry_run": False, "retired": [{"model_id": m, "version": v} for m, v in retired]})
        return
    console.print("retired: " + (", ".join(f"{m} {v}" for m, v in retired) or "nothing"))


@app.command(epilog=_examples("modelops rollback all-minilm-l6-v2", "modelops rollback all-minilm-l6-v2 --to 1 --json",
                              "modelops rollback all-minilm-l6-v2 --local   (in this process, no worker)"))
def rollback(
    model_id: str = typer.Argument(..., help="the model", autocompletion=_complete_models),
    to_version: str = typer.Option(None, "--to", help="the version to make the default (default: the newest earlier "
                                   "version that served)"),
    local: bool = typer.Option(False, "--local", help="run the rollback flow in this process, without a worker"),
    timeout: float = typer.Option(1800, min=1, help="seconds to follow the flow run"),
    as_json: bool = _json_option("print JSON"),
) -> None:
    """Make an earlier version of a model the default again (the rollback deployment).

    If the target was retired it is provisioned again from its sealed package and health
    checked before any traffic moves; the versions that were the default are drained and retired.
    """
    from tasks.traffic.rollback import plan_rollback

    settings = _settings()
    try:
        plan = plan_rollback(model_id, to_version)  # refuse a bad target before any run exists
    except ModelopsError as e:
        _fail(str(e), 2)
    if not as_json:
        console.print(f"rollback of {model_id}: {', '.join(plan.current)} → {plan.to}"
                      + (" (provisioned again from its package)" if plan.package else ""))
    if local:
        _require_prefect(local_run=True)
        from flows.rollback import rollback_flow

        state = rollback_flow(model_id, plan.to, return_state=True)
        _report_state(state, as_json, {"model_id": model_id, "to": plan.to})
        return
    _require_prefect()
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    try:
        run = run_deployment("rollback/rollback", parameters={"model_id": model_id, "to_version": plan.to},
                             timeout=0)
    except ObjectNotFound:
        _fail("the Prefect deployment rollback/rollback does not exist on this server: run `modelops up` "
              "(it deploys prefect.yaml), or use --local")
    _follow("", settings, timeout, wait=True, as_json=as_json, deployment="rollback",
            match=lambda r: r.id == run.id, extra={"model_id": model_id, "to": plan.to})


def _require_prefect(local_hint: bool = True, local_run: bool = False) -> None:
    """Exit 1 unless the Prefect API this CLI uses answers ``/health``, saying where its URL
    came from and what to do. ``local_run``: a --local run, which needs a server only when one
    is configured (else Prefect's ephemeral API records the run)."""
    import httpx

    url = os.environ.get("PREFECT_API_URL")
    if local_run and not url:
        return
    url = url or get_settings().prefect_api_url
    try:
        httpx.get(f"{url}/health", timeout=5).raise_for_status()
        return
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        problem = "is not a valid URL" if isinstance(e, (httpx.InvalidURL, httpx.UnsupportedProtocol)) \
            else "is not reachable"
    if _prefect_source in ("", "the local stack"):
        _fail(f"Prefect API at {url} {problem}: run `modelops up`"
              + (" (or use --local to run the flow in-process)" if local_hint else ""))
    _fail(f"Prefect API at {url} {problem} (the URL comes from {_prefect_source}): fix or unset it there"
          + ("; a --local run records its flow run on that server too" if local_run else ""))


def _report_state(state, as_json: bool, extra: dict) -> None:
    """Print a flow run's final state from an in-process (--local) run; exit 1 unless it completed.
    The JSON has the same keys as a followed run's."""
    if as_json:
        run_id = str(state.state_details.flow_run_id)
        _print_json({**extra, "event_id": None, "flow_run_id": run_id,
                     "flow_run_url": _flow_run_url(get_settings(), run_id), "state": state.name,
                     "message": state.message})
        if not state.is_completed():
            raise typer.Exit(1)
        return
    if state.is_completed():
        console.print(Text("completed: ", style="green") + Text(state.message or ""))
    else:
        _fail(f"flow run {state.name}: {state.message}")


@app.command(epilog=_examples("modelops package deployments/models/all-minilm-l6-v2.yaml",
                              "modelops package my-model.yaml --json | jq .archive_sha256"))
def package(
    manifest_file: Path = typer.Argument(..., help="model manifest (YAML)"),
    as_json: bool = _json_option("print package.json"),
) -> None:
    """Build and seal the package of a model version.

    Materializes its weights into the cache, builds (or reuses) the runtime, checks everything,
    writes package.tar.gz + package.json.
    """
    from modelops.archive import read_meta
    from tasks.image import build_runtime_image
    from tasks.materialize import materialize
    from tasks.package import build_package, check_engine_args, preflight

    try:
        manifest = load_manifest(manifest_file)
        preflight(manifest)
        image = build_runtime_image()
        # Engine args are checked before any weights move (the runtime knows its EngineArgs).
        check_engine_args(manifest.engine_args, json.loads(image.engine_args_schema.read_text()), image.vllm)
        weights = materialize(manifest)
        pkg = build_package(manifest, weights.path, image.lock_hash, engine_args_schema=image.engine_args_schema,
                            vllm_version=image.vllm, pin=image.pin, tool_parsers=image.tool_parsers())
    except ModelopsError as e:
        _fail(str(e), 2)
    meta = read_meta(pkg.path)
    if as_json:
        console.print(json.dumps({"path": str(pkg.path), **meta}, indent=1))
        return
    console.print(f"package {pkg.model_id} {pkg.version} sealed at {pkg.path} ({pkg.packaging}, task {pkg.task}, "
                  f"{len(meta['files'])} files, archive sha256 {meta['archive_sha256'][:12]}); "
                  f"serve it with: modelops serve {pkg.path}")


@app.command(epilog=_examples("modelops serve .modelops/packages/all-minilm-l6-v2/1 --port 8000",
                              "modelops serve my-local-model.yaml"))
def serve(
    target: Path = typer.Argument(..., help="a package folder (from `modelops package`), or a manifest whose "
                                  "source is a local directory"),
    port: int = typer.Option(8000, help="port of the OpenAI API"),
) -> None:
    """Run one runtime instance in the foreground: Triton + the OpenAI frontend on a package."""
    from modelops.archive import META, read_meta
    from tasks.image import build_runtime_image

    try:
        if target.is_dir():
            meta = read_meta(target)
            image = build_runtime_image()
            if meta.get("runtime_lock_hash") != image.lock_hash:
                _fail(f"package {target} was built for runtime {meta.get('runtime_lock_hash')}, this runtime is "
                      f"{image.lock_hash}; rebuild it with `modelops package`", 2)
            pkg_path, name = target.resolve(), f"{meta['model_id']}-{meta['version']}"
        elif target.suffix in (".yaml", ".yml"):
            from tasks.materialize import list_source
            from tasks.package import build_package

            manifest = load_manifest(target)
            if manifest.is_s3:
                _fail("source: serving a manifest needs a local directory or file:// source; use `modelops "
                      "package` for S3 sources, then serve the package", 2)
            list_source(manifest)
            weights = Path(manifest.source.removeprefix("file://")).expanduser().resolve()
            image = build_runtime_image()
            pkg = build_package(manifest, weights, image.lock_hash, engine_args_schema=image.engine_args_schema,
                                vllm_version=image.vllm, pin=image.pin, tool_parsers=image.tool_parsers())
            pkg_path, name = pkg.path, f"{manifest.model_id}-{manifest.version}"
        else:
            _fail(f"{target}: not a package folder (with {META}) or a manifest (.yaml)", 2)
    except ModelopsError as e:
        _fail(str(e), 2)
    settings = _settings()
    from tasks.provision.local import free_ports, runtime_command, runtime_env

    http, grpc, metrics = free_ports(3)
    console.print(f"serving {name}: OpenAI http://127.0.0.1:{port}/v1, "
                  f"KServe HTTP http://127.0.0.1:{http}, gRPC 127.0.0.1:{grpc}, metrics "
                  f"http://127.0.0.1:{metrics}/metrics (ready when GET /ready answers 200)")
    # Its own work folder: a second `serve` of the same package must not replace this one's files.
    cmd = runtime_command(image, pkg_path, settings.run_dir / "serve" / f"{name}-{os.getpid()}", port, http, grpc,
                          metrics)
    os.execve(cmd[0], cmd, runtime_env(image, settings))


DAEMONS = ("s3", "prefect-server", "prefect-worker")


@app.command(epilog=_examples(
    "modelops logs all-minilm-l6-v2            (its live instances' logs: Triton, vLLM, the frontend)",
    "modelops logs all-minilm-l6-v2 2 -n 200   (one version)",
    "modelops logs prefect-worker -f           (a daemon of the local stack, followed)",
    "modelops logs 0b6c1a2e-...                (a flow run's logs from Prefect)",
    "modelops logs all-minilm-l6-v2 --json"))
def logs(
    target: str = typer.Argument(..., help="a model id, an instance name, a flow run id, or a daemon: "
                                 + ", ".join(DAEMONS), autocompletion=lambda incomplete: [
                                     x for x in (*DAEMONS, *_complete_models(incomplete)) if x.startswith(incomplete)]),
    version: str = typer.Argument(None, help="only this version of the model"),
    lines: int = typer.Option(50, "--lines", "-n", min=1, help="last lines of each log"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines (Ctrl-C stops)"),
    as_json: bool = _json_option("print JSON"),
) -> None:
    """Show the logs of a model's instances, a flow run, or a local daemon."""
    settings = _settings()
    try:
        run_id = uuid.UUID(target)
    except ValueError:
        run_id = None
    if run_id is not None:
        _flow_run_logs(settings, run_id, lines, as_json)
        return
    if target in DAEMONS:
        files = [settings.log_dir / f"{target}.log"]
    else:
        registry = Registry(settings.registry)
        instances = [i for i in registry.instances(live=False)
                     if i.name == target or (i.model_version.model_id == target
                                             and version in (None, i.model_version.version))]
        live = [i for i in instances if i.state != "stopped"]
        chosen = live or instances[-1:]  # nothing live: the newest instance's log
        if not chosen:
            known = sorted({v.model_id for v in registry.versions()})
            _fail(f"{target}{' ' + version if version else ''}: no instance in the registry (models: "
                  f"{', '.join(known) or 'none'}; daemons: {', '.join(DAEMONS)}; or pass a flow run id)", 2)
        files = [Path(i.log_path) for i in chosen]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        _fail(f"no log file at {', '.join(missing)} (not started yet, or its home was removed)")
    if as_json:
        _print_json([{"path": str(f), "lines": f.read_text(errors="replace").splitlines()[-lines:]} for f in files])
        return
    offsets = {}
    for f in files:
        text = f.read_text(errors="replace")
        console.print(Text(f"==> {f} <==", style="bold"))
        console.print("\n".join(text.splitlines()[-lines:]))
        offsets[f] = len(text.encode())
    while follow:
        time.sleep(0.5)
        for f in files:
            with f.open("rb") as fh:
                fh.seek(offsets[f])
                new = fh.read()
            if new:
                offsets[f] += len(new)
                console.print(new.decode(errors="replace"), end="")


def _flow_run_logs(settings: Settings, run_id: uuid.UUID, lines: int, as_json: bool) -> None:
    _require_prefect(local_hint=False)
    import anyio
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.exceptions import ObjectNotFound

    async def read():
        async with get_client() as client:
            try:
                run = await client.read_flow_run(run_id)
            except ObjectNotFound:
                return None, []
            # The newest lines first, a page (the API's limit, 200) at a time.
            found, offset = [], 0
            while len(found) < lines:
                page = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])),
                                              limit=min(200, lines - len(found)), offset=offset,
                                              sort=LogSort.TIMESTAMP_DESC)
                found += page
                offset += len(page)
                if not page:
                    break
            return run, list(reversed(found))

    run, records = anyio.run(read)
    if run is None:
        _fail(f"no flow run {run_id} on {os.environ.get('PREFECT_API_URL') or settings.prefect_api_url}", 2)
    records = records[-lines:]
    if as_json:
        _print_json({"flow_run": run.name, "state": run.state.name if run.state else None,
                     "logs": [{"timestamp": r.timestamp.isoformat(), "level": _level_name(r.level),
                               "message": r.message} for r in records]})
        return
    console.print(Text(f"==> flow run {run.name} ({run.state.name if run.state else '?'}): "
                       f"{_flow_run_url(settings, str(run_id))} <==", style="bold"))
    for r in records:
        console.print(f"{r.timestamp:%H:%M:%S} {_level_name(r.level):<7} {r.message}")


def _level_name(level: int) -> str:
    import logging

    return logging.getLevelName(level)


@app.command("up", epilog=_examples("modelops up", "modelops up && modelops announce my-model.yaml --wait"))
def up() -> None:
    """Start the local stack (idempotent).

    moto S3, the Prefect server and UI, the deployments of prefect.yaml with a process worker,
    and HAProxy; then every version that was serving when `modelops down` ran serves again, with
    its weight, from its sealed package.
    """
    stack_up()


@app.command("down", epilog=_examples("modelops down"))
def down() -> None:
    """Stop every serving instance and everything `modelops up` started, by recorded pid; the
    versions that were serving are recorded as stopped (weights kept) for `modelops up`."""
    stack_down()


@stack_app.command("up")
def stack_up() -> None:
    """Start moto S3, Prefect server, the deployments and their worker, and HAProxy (idempotent);
    then serve again every version `down` stopped (tasks/restore.py)."""
    from modelops.stack import daemons, ensure_automations, prefect_env
    from tasks.restore import restore_stopped
    from tasks.traffic.haproxy import HAProxyRouter
    from tasks.traffic.interface import routes_from_registry

    settings = _settings()
    ds = daemons(settings)
    try:
        for name in ("s3", "prefect-server"):
            started = ds[name].start()
            console.print(f"{name}: {'started' if started else 'already running'} (pid {ds[name].pid()})")
        env = prefect_env(settings)
        for cmd in (["work-pool", "create", settings.work_pool, "--type", "process", "--overwrite"],
                    ["--no-prompt", "deploy", "--all"]):
            proc = subprocess.run([str(Path(sys.executable).parent / "prefect"), *cmd], env=env,
                                  cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
            if proc.returncode != 0:
                _fail(f"prefect {' '.join(cmd)} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
        console.print("deployments: model-lifecycle (trigger modelops.model.announced), cleanup-idle-versions (cron), "
                      "rollback (manual)")
        try:  # an optional safety net: its failure must not keep the stack down
            for name, how in ensure_automations(settings.prefect_api_url).items():
                console.print(f"automation: {name}: {how}")
        except ModelopsError as e:
            err.print(f"warning: {e}; flow runs of a killed worker will stay Running in the UI")
        started = ds["prefect-worker"].start()
        console.print(f"prefect-worker: {'started' if started else 'already running'} (pool {settings.work_pool})")
        router = HAProxyRouter(settings)
        was = router.pid()
        router.ensure_running(routes_from_registry(Registry(settings.registry)))
        console.print(f"haproxy: {'already running' if was else 'started'} (pid {router.pid()})")
        # What `modelops down` stopped serves again, from its sealed package, before up returns.
        restored = restore_stopped(settings, say=console.print)
    except ModelopsError as e:
        _fail(str(e))
    if lost := [r for r in restored if not r.ok]:
        err.print(f"warning: {len(lost)} version(s) not served again: " +
                  "; ".join(f"{r.model_id} {r.version}: {r.reason}" for r in lost))
    _print_endpoints(settings)


def _print_endpoints(settings: Settings) -> None:
    console.print(f"router (OpenAI): {settings.router_url}\nPrefect UI:      http://127.0.0.1:{settings.prefect_port}"
                  f"\nS3 endpoint:     {settings.s3_endpoint}")


@stack_app.command("down")
def stack_down() -> None:
    """Stop every serving instance and what `stack up` started, by recorded pid."""
    from modelops.process import stop_process_group
    from modelops.stack import daemons, flow_run_processes
    from tasks.restore import stop_serving_instances
    from tasks.traffic.haproxy import HAProxyRouter

    settings = _settings()
    ds = daemons(settings)
    # The worker and its flow runs first: a rollout must not see its instances go and react
    # (roll back, scale up again) while they are being stopped.
    console.print(f"prefect-worker: {'stopped' if ds['prefect-worker'].stop() else 'was not running'}")
    runs = flow_run_processes(settings)  # they run in sessions of their own and outlive the worker
    for pid in runs:
        stop_process_group(pid, timeout=20)
    if runs:
        console.print(f"flow runs: stopped {len(runs)} (pids {', '.join(map(str, runs))})")
    # Serving versions become "stopped" with their weights kept: `modelops up` serves them again.
    try:
        stop_serving_instances(settings, say=console.print)
    except ModelopsError as e:
        err.print(f"warning: {e}")
    router = HAProxyRouter(settings)
    was = router.pid()
    router.stop()
    console.print(f"haproxy: {'stopped' if was else 'was not running'}")
    for name, d in reversed(list(ds.items())):
        if name != "prefect-worker":
            console.print(f"{name}: {'stopped' if d.stop() else 'was not running'}")


@image_app.command("plan", epilog=_examples("modelops image plan --triton-release 26.07",
                                            "modelops image plan --triton-release 25.09 --vllm 0.11.2   (refused)",
                                            "modelops image plan --triton-release local-cpu --json"))
def image_plan(
    triton_release: str = typer.Option(None, "--triton-release", help="NGC release YY.MM (default: the production "
                                       "pin); 'local-cpu' shows the local row"),
    vllm: str = typer.Option(None, "--vllm", help="run this vLLM release instead of the one the image bundles"),
    out: Path = typer.Option(None, "--out", help="folder inside the repository for Dockerfile and requirements.lock "
                             "(default deployments/runtime/ngc/out)"),
    as_json: bool = _json_option("print JSON"),
) -> None:
    """Plan a production runtime image and probe it before anything is built.

    Checks the vLLM modules and names that Triton's official vLLM backend of that release and
    our backend import against the vLLM release's source; prints the Dockerfile, the lock and
    the content-derived image tag. Exit 1 when a check fails.
    """
    from modelops.compat import LOCAL_CPU, PRODUCTION

    release = PRODUCTION.name if triton_release is None else triton_release
    try:
        if release == LOCAL_CPU.name:
            if vllm:
                _fail(f"--vllm {vllm}: local-cpu is pinned to vLLM {LOCAL_CPU.vllm} by its lock file; "
                      "--vllm applies to NGC releases only", 2)
            _print_local_plan(as_json)
            return
        from tasks.image import DEFAULT_PLAN_DIR, plan_image

        out = out or DEFAULT_PLAN_DIR
        plan = plan_image(release, vllm, out_dir=out)
    except ModelopsError as e:
        _fail(str(e))
    if as_json:
        console.print(json.dumps({"release": plan.pin.name, "image": plan.pin.image, "tag": plan.tag,
                                  "vllm": plan.vllm, "bundled_vllm": plan.pin.vllm,
                                  "dockerfile_path": str(out / "Dockerfile"), "checks": plan.checks,
                                  "warnings": plan.warnings,
                                  "dockerfile": plan.dockerfile, "lock": plan.lock}, indent=1))
        return
    pin = plan.pin
    bundled = plan.vllm == pin.vllm_index
    console.print(f"Triton {pin.triton_release} (tritonserver {pin.tritonserver}, Python {pin.python}, CUDA {pin.cuda})"
                  f" with vLLM {pin.vllm if bundled else plan.vllm}"
                  + (f" (checked against the PyPI source of {plan.vllm})" if bundled and pin.vllm_public != plan.vllm
                     else "" if bundled else f" (bundled: {pin.vllm})"))
    for line in plan.checks:
        console.print(f"  ok   {line}")
    for line in plan.warnings:
        console.print(f"  note {line}")
    console.print(f"tag: {plan.tag}")
    console.print(f"--- Dockerfile ({out / 'Dockerfile'})")
    console.print(plan.dockerfile.rstrip())
    console.print(f"--- requirements.lock ({out / 'requirements.lock'})")
    console.print(plan.lock.rstrip())


def _print_local_plan(as_json: bool) -> None:
    from modelops.compat import LOCAL_CPU
    from tasks.image import LOCK_FILE, lock_hash

    info = {"release": LOCAL_CPU.name, "tritonserver": LOCAL_CPU.tritonserver, "triton_release": LOCAL_CPU.triton_release,
            "vllm": LOCAL_CPU.vllm, "python": LOCAL_CPU.python, "source": LOCAL_CPU.image,
            "lock": str(LOCK_FILE), "lock_hash": lock_hash(),
            "torch": LOCAL_CPU.packages.get("torch", ""), "tritonclient": LOCAL_CPU.packages.get("tritonclient", "")}
    if as_json:
        console.print(json.dumps(info, indent=1))
        return
    console.print(f"local-cpu: tritonserver {info['tritonserver']} (Triton {info['triton_release']}) + vLLM "
                  f"{info['vllm']} (CPU), torch {info['torch']}, Python {info['python']}")
    console.print(f"  from {info['source']}")
    console.print(f"  lock {info['lock']} (hash {info['lock_hash']}); built as a virtual environment by "
                  "`modelops image build`, probed after the build")


@image_app.command("matrix", epilog=_examples("modelops image matrix", "modelops image matrix --json"))
def image_matrix(as_json: bool = _json_option("print JSON")) -> None:
    """The Triton/vLLM compatibility matrix modelops knows (Triton's published table)."""
    from modelops.compat import BASE_TORCH, LOCAL_CPU, TRITON_MATRIX

    rows = [*TRITON_MATRIX, LOCAL_CPU]
    # The image's torch where a source records it (modelops.compat.BASE_TORCH), the lock's locally.
    torch = {p.name: BASE_TORCH.get(p.name, ("",))[0] for p in TRITON_MATRIX} | {
        LOCAL_CPU.name: LOCAL_CPU.packages.get("torch", "")}
    if as_json:
        console.print(json.dumps([{**{k: getattr(p, k) for k in ("name", "triton_release", "tritonserver", "vllm",
                                                                   "python", "cuda", "image")},
                                   "torch": torch[p.name] or None} for p in rows], indent=1))
        return
    table = Table("release", "tritonserver", "vLLM", "torch", "Python", "CUDA", "image")
    for p in rows:
        table.add_row(p.name, p.tritonserver, p.vllm, torch[p.name] or "?", p.python, p.cuda or "-", p.image)
    _print_table(table)


@image_app.command("build", epilog=_examples("modelops image build"))
def image_build() -> None:
    """Build (or reuse) the local runtime environment from the pinned lock, then probe it."""
    from tasks.image import build_runtime_image

    t0 = time.monotonic()
    try:
        image = build_runtime_image()
    except ModelopsError as e:
        _fail(str(e))
    console.print(f"runtime {image.lock_hash} ready at {image.path} (vLLM {image.vllm}, tritonserver "
                  f"{image.pin.tritonserver}, Triton {image.pin.triton_release}) in {time.monotonic() - t0:.0f} s")


@cache_app.command("pull", epilog=_examples("modelops cache pull deployments/models/all-minilm-l6-v2.yaml"))
def cache_pull(manifest_file: Path = typer.Argument(..., help="model manifest (YAML)")) -> None:
    """Materialize a manifest's weights onto FSx now, with a progress bar (resumable)."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from tasks.materialize import materialize

    settings = _settings()
    try:
        manifest = load_manifest(manifest_file)
    except ModelopsError as e:
        _fail(str(e), 2)
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err) as bar:
        job = bar.add_task(f"{manifest.model_id} {manifest.version}", total=None)
        try:
            result = materialize(manifest, settings, progress=lambda n: bar.advance(job, n),
                                 total_callback=lambda todo: bar.update(job, total=todo))
        except ModelopsError as e:
            bar.stop()
            _fail(str(e))
        except KeyboardInterrupt:
            bar.stop()
            _fail(f"interrupted: what was written stays in {settings.fsx_dir / manifest.model_id}/.staging-"
                  f"{manifest.version}; `modelops cache pull {manifest_file}` again resumes from it", 130)
    if result.transferred:
        console.print(f"{result.path}: {result.files} files, {result.bytes / 1e6:.1f} MB; "
                      f"{result.transferred / 1e6:.1f} MB transferred in {result.seconds:.1f} s ({result.mb_per_s:.0f} MB/s)")
    else:
        console.print(f"{result.path}: cache hit, nothing transferred ({result.files} files, {result.bytes / 1e6:.1f} MB)")


@cache_app.command("ls", epilog=_examples("modelops cache ls", "modelops cache ls --json"))
def cache_ls(as_json: bool = _json_option("print JSON")) -> None:
    """Versions on FSx, least recently used first, with their registry state; then staging
    folders (state "pull in progress", or "abandoned staging": `cache evict` reclaims those)."""
    from datetime import datetime

    from tasks.materialize import cached_versions, leftovers

    settings = _settings()
    states = {(v.model_id, v.version): v.state for v in Registry(settings.registry).versions()}
    rows = [{**v, "path": str(v["path"]), "state": states.get((v["model_id"], v["version"]), "-")}
            for v in cached_versions(settings)]
    # Staging folders are rows too (JSON stays one list): abandoned ones `cache evict` reclaims.
    left = [{"model_id": v["model_id"], "version": v["version"], "path": str(v["path"]), "bytes": v["bytes"],
             "last_used": v["last_used"], "state": "pull in progress" if v["in_use"] else "abandoned staging"}
            for v in leftovers(settings)]
    if as_json:
        print(json.dumps(rows + left, indent=2))
        return
    table = Table("model", "version", "MB", "last used", "registry state", "path")
    for r in rows + left:
        table.add_row(r["model_id"], r["version"], f"{r['bytes'] / 1e6:.1f}",
                      datetime.fromtimestamp(r["last_used"]).isoformat(timespec="seconds"), r["state"], r["path"])
    _print_table(table)
    console.print(f"total {sum(r['bytes'] for r in rows) / 1e6:.1f} MB in {settings.fsx_dir}")
    if abandoned := [r for r in left if r["state"] == "abandoned staging"]:
        console.print(f"{len(abandoned)} abandoned staging folder(s) hold {sum(r['bytes'] for r in abandoned) / 1e6:.1f}"
                      " MB more: a `cache pull` of that version resumes from one, `cache evict` reclaims them")


@cache_app.command("evict", epilog=_examples("modelops cache evict --budget-gb 50", "modelops cache evict",
                                              "modelops cache evict all-minilm-l6-v2 1"))
def cache_evict(model_id: str = typer.Argument(None, help="with VERSION: remove this one version (not in use)"),
                version: str = typer.Argument(None, help="the version to remove"),
                budget_gb: float = typer.Option(
                    None, help="keep at most this many GB (default: setting cache_budget_gb; neither: only reclaim "
                    "abandoned staging folders)")) -> None:
    """Reclaim abandoned staging folders, then remove least recently used versions beyond the
    budget; never a version in use, never a pull in progress. With MODEL VERSION: remove that
    version only (e.g. after `cache verify` found it damaged)."""
    from tasks.materialize import cached_versions, evict, evict_version

    settings = _settings()
    if model_id is not None:
        if version is None:
            _fail("give both MODEL and VERSION to remove one version, or neither", 2)
        try:
            gone = evict_version(model_id, version, settings)
        except ModelopsError as e:
            _fail(str(e), 2)
        console.print(f"evicted {model_id} {version} ({gone['bytes'] / 1e6:.1f} MB); `modelops cache pull` fetches "
                      "it again")
        return
    budget = budget_gb if budget_gb is not None else settings.cache_budget_gb
    if budget is not None and not (0 <= budget < float("inf")):
        _fail(f"--budget-gb must be a finite number ≥ 0, got {budget}", 2)
    removed = evict(int(budget * 1e9) if budget is not None else None, settings)
    for v in removed:
        if v["leftover"]:
            console.print(f"reclaimed {v['path']} ({v['bytes'] / 1e6:.1f} MB, abandoned staging)")
        else:
            console.print(f"evicted {v['model_id']} {v['version']} ({v['bytes'] / 1e6:.1f} MB)")
    if not removed:
        console.print("nothing evicted" + ("" if budget is not None else
                                           " (no budget: pass --budget-gb or set MODELOPS_CACHE_BUDGET_GB to evict "
                                           "versions too)"))
    left = sum(v["bytes"] for v in cached_versions(settings))
    if budget is not None and left > budget * 1e9:
        console.print(f"still {left / 1e9:.2f} GB cached, over the {budget} GB budget: the rest is in use "
                      "(provisioning, serving or draining)")


@cache_app.command("verify", epilog=_examples("modelops cache verify all-minilm-l6-v2 1"))
def cache_verify(model_id: str = typer.Argument(..., help="model id"),
                 version: str = typer.Argument(..., help="version")) -> None:
    """Re-hash a cached copy against its completion record (sha256, ETag with its part layout,
    size); exit 1 naming each file that differs."""
    from tasks.materialize import verify_cached

    try:
        report = verify_cached(model_id, version, _settings())
    except ModelopsError as e:
        _fail(str(e), 2)
    for problem in report["problems"]:
        err.print(problem)
    checked = ", ".join(f"{n} by {kind}" for kind, n in sorted(report["checked"].items()))
    if report["problems"]:
        _fail(f"{model_id} {version} at {report['path']}: {len(report['problems'])} of {report['files']} file(s) "
              f"differ from the record; `modelops cache evict {model_id} {version}` then `modelops cache pull` "
              "fetches it again")
    console.print(f"{model_id} {version} at {report['path']}: {report['files']} files match their record ({checked})")


if __name__ == "__main__":
    app()
