"""The model-version commands: announce, status, promote, cleanup, rollback, package, serve, logs."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from modelops.errors import ManifestError, ModelopsError
from modelops.manifest import Manifest, load_manifest
from modelops.registry import Registry
from modelops.settings import Settings
from modelops_cli.app import app
from modelops_cli.output import (
    complete_models,
    console,
    err,
    examples,
    fail,
    json_option,
    load_settings,
    print_json,
    print_table,
)
from modelops_cli.prefect_api import (
    flow_run_logs,
    follow,
    report_state,
    require_prefect,
)


EVENT = "modelops.model.announced"


@app.command(epilog=examples(
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
    as_json: bool = json_option("print JSON (event id, flow run id and URL, final state)"),
) -> None:
    """Announce a model version: emit the Prefect event modelops.model.announced.

    The model-lifecycle deployment's trigger starts a flow run; its URL is printed as soon as
    the run exists. The manifest is checked first: a bad one is refused (exit 2) before any event.
    """
    try:
        manifest = load_manifest(manifest_file)
    except ModelopsError as e:
        fail(str(e), 2)
    try:
        from tasks.package import preflight

        preflight(manifest)  # with engine args and tool parser against the pinned image: before any byte moves
        _check_event_size(manifest)
    except ModelopsError as e:
        fail(f"{manifest_file}: {e}", 2)  # as load_manifest's own errors name it
    settings = load_settings()
    if local:
        _warn_one_region(settings, "announce --local rolls out", "announce without --local: the global rollout")
        require_prefect(local_run=True)
        _announce_local(manifest, settings, as_json)
        return
    if os.environ.get("MODELOPS_FAIL_STAGE"):
        err.print("warning: MODELOPS_FAIL_STAGE is ignored here: the worker runs the flow with the environment "
                  "it got at `modelops up`; use --local for a failure drill")
    require_prefect()
    from prefect.events import emit_event
    from prefect.events.clients import get_events_client
    from prefect.events.worker import EventsWorker

    from modelops.regions import GLOBAL_EVENT, RegionsError, load_regions

    try:  # a regions file: the global rollout takes the announcement, wave by wave
        regional = load_regions(settings) is not None
    except RegionsError as e:
        fail(f"{e} (`modelops regions check` says the same)", 2)
    event = GLOBAL_EVENT if regional else EVENT
    event_id = uuid.uuid4()
    emit_event(event=event, resource={"prefect.resource.id": f"modelops.model.{manifest.model_id}",
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
                      f"(event {event}, id {event_id})")
    follow(str(event_id), settings, timeout if wait else min(timeout, 60), wait=wait, as_json=as_json,
           deployment="global-rollout" if regional else "model-lifecycle",
           extra={"model_id": manifest.model_id, "version": manifest.version})


def _warn_one_region(settings: Settings, what: str, instead: str) -> None:
    """With a regions file, say on stderr that ``what`` acts on this stack's region alone."""
    from modelops.regions import RegionsError, load_regions

    try:
        plan = load_regions(settings)
    except RegionsError:
        return  # the command itself does not read it
    if plan is not None:
        err.print(f"warning: {what} this stack's region only ({settings.region or plan.regions[0].name}), not the "
                  f"other {len(plan.regions) - 1} of {settings.regions_path}; for every region: {instead}")


def _check_event_size(manifest: Manifest) -> None:
    """The announcement travels as one Prefect event; refuse one larger than the server
    accepts (``PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES``, 1,500,000 by default) before emitting.

    Raises: ManifestError with the sizes."""
    from prefect.settings import PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES

    limit = PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES.value()
    size = len(json.dumps(manifest.model_dump(mode="json")).encode()) + 1024  # + the event's own fields
    if size > limit:
        raise ManifestError(f"manifest: the announcement would be an event of about {size:,} bytes; the Prefect "
                            f"server accepts at most {limit:,} (PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES): shorten "
                            "the manifest (engine_args, io_schema)")


def _announce_local(manifest: Manifest, settings: Settings, as_json: bool = False) -> None:
    # The local stack's server records the run when it is up (prefect_target), else Prefect's
    # ephemeral API does.
    from flows.lifecycle import model_lifecycle

    state = model_lifecycle(manifest, f"local-{uuid.uuid4()}", return_state=True)
    report_state(state, as_json, {"model_id": manifest.model_id, "version": manifest.version})


@app.command(epilog=examples("modelops status", "modelops status --json | jq '.models[].versions[] | {version, state, weight}'"))
def status(as_json: bool = json_option("print JSON")) -> None:
    """Models, versions, states, weights and endpoints from the registry, with what the router
    measured per instance (requests, 5xx, retries, redispatches, time to first byte), and each
    version's scaling policy with the autoscaler's latest decision."""
    from modelops_cli.regions import print_regions_status, regions_status
    from tasks.backends import router

    settings = load_settings()
    registry = Registry(settings.registry)
    data = registry.status()
    data["router"] = router(settings).instance_traffic()  # {instance name: figures}; {} without any
    # Running experiments: their arms decide unpinned OpenAI traffic, not the weights.
    data["experiments"] = {e.model_id: {"arms": {a.version: a.percent for a in e.spec().arms}, "key": e.key,
                                        "default": e.default_version} for e in registry.experiments()}
    data["shadows"] = {s.model_id: {"version": s.version, "percent": s.percent, "origin": s.origin}
                       for s in registry.shadows()}
    try:  # with a regions file: every region's versions, from its own registry
        regions = regions_status(settings)
    except ModelopsError as e:
        err.print(f"warning: no other region shown: {e}")
        regions = None
    if regions is not None:
        data["regions"] = regions
    if as_json:
        print(json.dumps(data, indent=2))
        return
    table = Table("model", "version", "state", "weight", "strategy", "mode", "instance", "OpenAI", "KServe gRPC",
                  "scaling", "reason")
    for m in data["models"]:
        for v in m["versions"]:
            at_zero = v["state"] == "serving" and (v.get("scaling") or {}).get("min") == 0
            instances = list(v["endpoints"].items()) or [("none: the router holds requests\nuntil one starts"
                                                          if at_zero else "-", {})]
            for row, (name, e) in enumerate(instances):
                inst = v.get("instances", {}).get(name, {})
                shown = name
                if inst.get("state") not in (None, "running"):
                    shown += f" ({inst['state']})"
                if inst.get("restarts"):  # its supervisor restarted it: say how often and why
                    shown += f"\nrestarted {inst['restarts']}x, last: {inst['last_exit'][:160]}"
                separate = v["execution_mode"] == "separate"  # no OpenAI face: its port answers /ready only
                table.add_row(m["model_id"], v["version"], v["state"], str(v["weight"]), v["strategy"],
                              v["execution_mode"] + (f"\n{v['framework']}" if v["framework"] != "vllm" else ""), shown,
                              "-" if separate else e.get("openai", "-"), e.get("kserve_grpc", "-"),
                              "" if row else scaling_text(v.get("scaling"), v.get("last_scale")), v["reason"] or "")
    print_table(table)
    for model_id, e in data["experiments"].items():
        arms = ", ".join(f"{v} {p} %" for v, p in e["arms"].items())
        console.print(f"experiment on {model_id}: {arms} by {e['key']} (default {e['default']}); its unpinned OpenAI "
                      "requests follow the arms, not the weights (`modelops experiment status`)")
    for model_id, sh in data["shadows"].items():
        console.print(f"shadow of {model_id}: version {sh['version']} gets copies of {sh['percent']} % of its "
                      f"unpinned requests (started by {sh['origin']}; `modelops shadow status {model_id}`)")
    if regions is not None:
        print_regions_status(regions)


def scaling_text(policy: dict | None, last: dict | None) -> str:
    """A version's scaling policy and the autoscaler's latest decision, for the status table:
    ``1..2 on waiting 1`` then ``last: 1→2 done (61 s)``; ``-`` for one fixed instance."""
    policy = policy or {"min": 1, "max": 1}
    if policy["max"] == policy["min"]:
        text = "-" if policy["min"] == 1 else f"{policy['min']} fixed"
    else:
        text = f"{policy['min']}..{policy['max']}"
        if policy.get("target"):
            (signal, value), = policy["target"].items()
            text += f" on {signal} {value:g}"
        else:  # {min: 0, max: 1}: idleness alone decides
            text += ", zero when idle"
    if last:
        took = f" ({last['seconds']:.0f} s)" if last.get("seconds") is not None else ""
        text += f"\nlast: {last['before']}→{last['after']} {last['outcome']}{took}"
        if last["outcome"] == "failed":
            text += f": {last['detail'][:160]}"
    return text


@app.command(epilog=examples("modelops promote all-minilm-l6-v2 2", "modelops promote all-minilm-l6-v2 2 --json"))
def promote(
    model_id: str = typer.Argument(..., help="the model", autocompletion=complete_models),
    version: str = typer.Argument(..., help="the version to make the default for unpinned requests"),
    as_json: bool = json_option("print JSON"),
) -> None:
    """Make a fully ready version the model's default route.

    The previous default keeps serving requests pinned with X-Model-Version until cleanup
    retires it.
    """
    from tasks.lock import rollout_lock
    from tasks.traffic.promote import promote as do_promote

    settings = load_settings()
    row = Registry(settings.registry).get_version(model_id, version)
    if not Registry(settings.registry).versions(model_id):
        fail(f"model {model_id!r} is not in the registry (`modelops status` lists the models)", 2)
    if row is None or row.state != "serving":
        known = ", ".join(f"{v.version} ({v.state})" for v in Registry(settings.registry).versions(model_id))
        fail(f"{model_id} {version} is {row.state if row else 'not announced'}; only a serving version can become "
              f"the default (versions: {known or 'none'}; a retired one must be announced again, or use "
              f"`modelops rollback {model_id} --to VERSION`)", 2)
    if row.weight == 100:
        fail(f"{model_id} {version} is already the default (weight 100)", 2)
    try:
        # Not in the middle of a rollout of the same model (waits up to a minute for one to end).
        with rollout_lock(model_id, holder=f"modelops promote (pid {os.getpid()})", wait_s=60):
            result = do_promote(model_id, version)
    except ModelopsError as e:
        fail(str(e))
    if as_json:
        print_json(result)
        return
    console.print(promoted_text(model_id, result))


def promoted_text(model_id: str, result: dict) -> str:
    """What a promotion did (tasks.traffic.promote.promote's result), for the user."""
    return (f"{model_id}: default is now {result['default']} (previous: {', '.join(result['previous']) or '-'}; "
            f"they keep serving pinned requests). Both versions have run side by side for "
            f"{result['overlap_instance_hours']} instance-hours.")


@app.command(epilog=examples("modelops cleanup --dry-run", "modelops cleanup --idle-after 0 --model all-minilm-l6-v2 --json"))
def cleanup(
    idle_after: float = typer.Option(600, "--idle-after", help="seconds a version must have had no traffic"),
    model_id: str = typer.Option(None, "--model", help="only this model", autocompletion=complete_models),
    dry_run: bool = typer.Option(False, "--dry-run", help="print what would be removed, remove nothing"),
    as_json: bool = json_option("print JSON"),
) -> None:
    """Retire idle versions (replaced, weight 0, no traffic for --idle-after seconds).

    Never the latest serving version of a model, never one with weight above 0. The
    cleanup-idle-versions deployment runs the same on a cron schedule.
    """
    from modelops.registry import Registry
    from tasks.cleanup import cleanup_idle_versions, idle_versions

    settings = load_settings()
    import math

    if not math.isfinite(idle_after) or idle_after < 0:
        fail(f"--idle-after must be a finite number of seconds ≥ 0, got {idle_after}", 2)
    if model_id is not None and not Registry(settings.registry).versions(model_id):
        fail(f"--model {model_id}: no such model in the registry (`modelops status` lists them)", 2)
    if dry_run:
        targets = idle_versions(Registry(settings.registry), idle_after, model_id)
        if as_json:
            print_json({"dry_run": True, "would_retire": [{"model_id": m, "version": v} for m, v in targets]})
            return
        console.print("would retire: " + (", ".join(f"{m} {v}" for m, v in targets) or "nothing"))
        return
    retired = cleanup_idle_versions(idle_after, model_id)
    if as_json:
        print_json({"dry_run": False, "retired": [{"model_id": m, "version": v} for m, v in retired]})
        return
    console.print("retired: " + (", ".join(f"{m} {v}" for m, v in retired) or "nothing"))


@app.command(epilog=examples("modelops rollback all-minilm-l6-v2", "modelops rollback all-minilm-l6-v2 --to 1 --json",
                              "modelops rollback all-minilm-l6-v2 --local   (in this process, no worker)"))
def rollback(
    model_id: str = typer.Argument(..., help="the model", autocompletion=complete_models),
    to_version: str = typer.Option(None, "--to", help="the version to make the default (default: the newest earlier "
                                   "version that served)"),
    local: bool = typer.Option(False, "--local", help="run the rollback flow in this process, without a worker"),
    timeout: float = typer.Option(1800, min=1, help="seconds to follow the flow run"),
    as_json: bool = json_option("print JSON"),
) -> None:
    """Make an earlier version of a model the default again (the rollback deployment).

    If the target was retired it is provisioned again from its sealed package and health
    checked before any traffic moves; the versions that were the default are drained and retired.
    """
    from tasks.traffic.rollback import plan_rollback

    settings = load_settings()
    _warn_one_region(settings, "rollback acts on", "run the deployment rollback/<region> of each (Prefect UI, or "
                     "`prefect deployment run rollback/<region> -p model_id=MODEL`)")
    if running := Registry(settings.registry).experiment(model_id):
        arms = ", ".join(f"{a.version}:{a.percent}" for a in running.spec().arms)
        fail(f"an experiment runs on {model_id} (arms {arms}); `modelops experiment stop {model_id} --keep VERSION` "
             "ends it, then roll back", 1)
    try:
        plan = plan_rollback(model_id, to_version)  # refuse a bad target before any run exists
    except ModelopsError as e:
        fail(str(e), 2)
    if not as_json:
        console.print(f"rollback of {model_id}: {', '.join(plan.current)} → {plan.to}"
                      + (" (provisioned again from its package)" if plan.package else ""))
    if local:
        require_prefect(local_run=True)
        from flows.rollback import rollback_flow

        state = rollback_flow(model_id, plan.to, return_state=True)
        report_state(state, as_json, {"model_id": model_id, "to": plan.to})
        return
    require_prefect()
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    try:
        run = run_deployment("rollback/rollback", parameters={"model_id": model_id, "to_version": plan.to},
                             timeout=0)
    except ObjectNotFound:
        fail("the Prefect deployment rollback/rollback does not exist on this server: run `modelops up` "
              "(it deploys prefect.yaml), or use --local")
    follow("", settings, timeout, wait=True, as_json=as_json, deployment="rollback",
            match=lambda r: r.id == run.id, extra={"model_id": model_id, "to": plan.to})


@app.command(epilog=examples("modelops package deployments/models/all-minilm-l6-v2.yaml",
                              "modelops package my-model.yaml --json | jq .archive_sha256"))
def package(
    manifest_file: Path = typer.Argument(..., help="model manifest (YAML)"),
    as_json: bool = json_option("print package.json"),
) -> None:
    """Build and seal the package of a model version.

    Materializes its weights into the cache, builds (or reuses) the runtime, checks everything,
    writes package.tar.gz + package.json.
    """
    from modelops.archive import read_meta
    from tasks.image import build_runtime_image
    from tasks.materialize import materialize
    from tasks.package import check_engine_args, package_for_image, preflight

    load_settings()  # a bad MODELOPS_* variable is one error line, before anything else
    try:
        manifest = load_manifest(manifest_file)
    except ModelopsError as e:
        fail(str(e), 2)
    try:
        preflight(manifest)
    except ModelopsError as e:
        fail(f"{manifest_file}: {e}", 2)
    try:
        image = build_runtime_image()
        # Engine args are checked before any weights move (the runtime knows its EngineArgs).
        check_engine_args(manifest.engine_args, json.loads(image.engine_args_schema.read_text()), image.vllm)
        weights = materialize(manifest)
        pkg = package_for_image(manifest, weights.path, image)
    except ModelopsError as e:
        fail(str(e), 2)
    meta = read_meta(pkg.path)
    if as_json:
        console.print(json.dumps({"path": str(pkg.path), **meta}, indent=1))
        return
    console.print(f"package {pkg.model_id} {pkg.version} sealed at {pkg.path} ({pkg.packaging}, task {pkg.task}, "
                  f"{len(meta['files'])} files, archive sha256 {meta['archive_sha256'][:12]}); "
                  f"serve it with: modelops serve {pkg.path}")


@app.command(epilog=examples("modelops serve .modelops/packages/all-minilm-l6-v2/1 --port 8000",
                              "modelops serve my-local-model.yaml"))
def serve(
    target: Path = typer.Argument(..., help="a package folder (from `modelops package`), or a manifest whose "
                                  "source is a local directory"),
    port: int = typer.Option(8000, help="port of the OpenAI API (execution_mode separate: /health, /ready and "
                             "/metrics only)"),
    http_port: int = typer.Option(0, help="port of KServe v2 HTTP (0: a free one)"),
    grpc_port: int = typer.Option(0, help="port of KServe v2 gRPC (0: a free one)"),
) -> None:
    """Run one runtime instance in the foreground: Triton + its frontend on a package."""
    from modelops.archive import META, read_meta
    from tasks.image import build_runtime_image

    try:
        if target.is_dir():
            meta = read_meta(target)
            image = build_runtime_image()
            if meta.get("runtime_lock_hash") != image.lock_hash:
                fail(f"package {target} was built for runtime {meta.get('runtime_lock_hash')}, this runtime is "
                      f"{image.lock_hash}; rebuild it with `modelops package`", 2)
            pkg_path, name = target.resolve(), f"{meta['model_id']}-{meta['version']}"
            separate = meta.get("execution_mode") == "separate"
        elif target.suffix in (".yaml", ".yml"):
            from tasks.materialize import list_source
            from tasks.package import package_for_image

            manifest = load_manifest(target)
            if manifest.is_s3:
                fail("source: serving a manifest needs a local directory or file:// source; use `modelops "
                      "package` for S3 sources, then serve the package", 2)
            list_source(manifest)
            weights = Path(manifest.source.removeprefix("file://")).expanduser().resolve()
            image = build_runtime_image()
            pkg = package_for_image(manifest, weights, image)
            pkg_path, name = pkg.path, f"{manifest.model_id}-{manifest.version}"
            separate = manifest.execution_mode == "separate"
        else:
            fail(f"{target}: not a package folder (with {META}) or a manifest (.yaml)", 2)
    except ModelopsError as e:
        fail(str(e), 2)
    settings = load_settings()
    from tasks.provision.local import free_ports, runtime_command, runtime_env

    http, grpc, metrics = free_ports(3)
    http, grpc = http_port or http, grpc_port or grpc
    face = f"no OpenAI API (execution_mode separate), /ready on http://127.0.0.1:{port}" if separate else \
        f"OpenAI http://127.0.0.1:{port}/v1"
    console.print(f"serving {name}: {face}, KServe HTTP http://127.0.0.1:{http}, gRPC 127.0.0.1:{grpc}, metrics "
                  f"http://127.0.0.1:{metrics}/metrics (ready when GET /ready answers 200)")
    # Its own work folder: a second `serve` of the same package must not replace this one's files.
    cmd = runtime_command(image, pkg_path, settings.run_dir / "serve" / f"{name}-{os.getpid()}", port, http, grpc,
                          metrics)
    os.execve(cmd[0], cmd, runtime_env(image, settings))


DAEMONS = ("s3", "prefect-server", "prefect-worker", "autoscaler", "batch-api")


@app.command(epilog=examples(
    "modelops logs all-minilm-l6-v2            (its live instances' logs: Triton, vLLM, the frontend)",
    "modelops logs all-minilm-l6-v2 2 -n 200   (one version)",
    "modelops logs prefect-worker -f           (a daemon of the local stack, followed)",
    "modelops logs 0b6c1a2e-...                (a flow run's logs from Prefect)",
    "modelops logs all-minilm-l6-v2 --json"))
def logs(
    target: str = typer.Argument(..., help="a model id, an instance name, a flow run id, or a daemon: "
                                 + ", ".join(DAEMONS), autocompletion=lambda incomplete: [
                                     x for x in (*DAEMONS, *complete_models(incomplete)) if x.startswith(incomplete)]),
    version: str = typer.Argument(None, help="only this version of the model"),
    lines: int = typer.Option(50, "--lines", "-n", min=1, help="last lines of each log"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines (Ctrl-C stops)"),
    as_json: bool = json_option("print JSON"),
) -> None:
    """Show the logs of a model's instances, a flow run, or a local daemon."""
    settings = load_settings()
    try:
        run_id = uuid.UUID(target)
    except ValueError:
        run_id = None
    if run_id is not None:
        flow_run_logs(settings, run_id, lines, as_json)
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
            fail(f"{target}{' ' + version if version else ''}: no instance in the registry (models: "
                  f"{', '.join(known) or 'none'}; daemons: {', '.join(DAEMONS)}; or pass a flow run id)", 2)
        files = [Path(i.log_path) for i in chosen]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        fail(f"no log file at {', '.join(missing)} (not started yet, or its home was removed)")
    if as_json:
        print_json([{"path": str(f), "lines": f.read_text(errors="replace").splitlines()[-lines:]} for f in files])
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
