"""The local stack's commands: ``modelops up`` / ``down`` (and the older ``modelops stack up`` / ``down``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer

from modelops.errors import ModelopsError
from modelops.registry import Registry
from modelops.settings import Settings
from modelops_cli.app import app, stack_app
from modelops_cli.output import (
    console,
    err,
    examples,
    fail,
    load_settings,
)


@app.command("up", epilog=examples("modelops up", "modelops up && modelops announce my-model.yaml --wait",
                                    "modelops up --regions 2   (two regions on this machine: docs/regions.md)"))
def up(regions: int = typer.Option(None, "--regions", min=1, max=9, help="write a regions file for N regions on "
                                   "this machine first (region-1 is this stack); without it, the regions file "
                                   "that exists, if any, is used")) -> None:
    """Start the local stack (idempotent).

    moto S3, the Prefect server and UI, the deployments of prefect.yaml with a process worker,
    and HAProxy; then every version that was serving when `modelops down` ran serves again, with
    its weight, from its sealed package; then the autoscaler, which brings each version to its
    scaling policy's minimum and follows its load. With a regions file, each other region's work
    pool, worker, router and autoscaler too, and the regional deployments.
    """
    if regions is not None:
        from modelops_cli.regions import write_local_regions

        try:
            written = write_local_regions(load_settings(), regions)
            if regions > 1:
                console.print(f"regions file: {written}")
        except ModelopsError as e:
            fail(str(e), 2)
    stack_up()


@app.command("down", epilog=examples("modelops down"))
def down() -> None:
    """Stop every serving instance and everything `modelops up` started, by recorded pid; the
    versions that were serving are recorded as stopped (weights kept) for `modelops up`."""
    stack_down()


@stack_app.command("up")
def stack_up() -> None:
    """Start moto S3, Prefect server, the deployments and their worker, and HAProxy (idempotent);
    then serve again every version `down` stopped (tasks/restore.py)."""
    from modelops_cli.local_stack import daemons, ensure_automations, prefect_env
    from tasks.restore import restore_stopped
    from tasks.traffic.haproxy import HAProxyRouter
    from tasks.traffic.interface import routes_from_registry

    from modelops.regions import load_regions
    from modelops_cli.regions import regions_up

    settings = load_settings()
    ds = daemons(settings)
    try:
        plan = load_regions(settings)  # a bad regions file stops `up` before anything starts
    except ModelopsError as e:
        fail(str(e), 2)
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
                fail(f"prefect {' '.join(cmd)} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
        console.print("deployments: model-lifecycle (trigger modelops.model.announced), cleanup-idle-versions (cron), "
                      "rollback (manual), batch-inference (started by the batch API), global-rollout (trigger "
                      "modelops.model.announced.global, with a regions file)")
        try:  # an optional safety net: its failure must not keep the stack down
            for name, how in ensure_automations(settings).items():
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
        started = ds["autoscaler"].start()  # after the restore: it scales what serves
        console.print(f"autoscaler: {'started' if started else 'already running'} (pid {ds['autoscaler'].pid()})")
        started = ds["batch-api"].start()
        console.print(f"batch-api: {'started' if started else 'already running'} (pid {ds['batch-api'].pid()})")
        if plan is not None:
            regions_up(settings, plan)
    except ModelopsError as e:
        fail(str(e))
    if lost := [r for r in restored if not r.ok]:
        err.print(f"warning: {len(lost)} version(s) not served again: " +
                  "; ".join(f"{r.model_id} {r.version}: {r.reason}" for r in lost))
    _print_endpoints(settings)


def _print_endpoints(settings: Settings) -> None:
    console.print(f"router (OpenAI): {settings.router_url} (batches: {settings.router_url}/batches)\n"
                  f"router (KServe): http://127.0.0.1:{settings.router_port}/v2/models/<model_id>/..., gRPC "
                  f"127.0.0.1:{settings.router_grpc_port} (metadata x-model-id: <model_id>)\n"
                  f"Prefect UI:      http://127.0.0.1:{settings.prefect_port} (sign in with the API auth string "
                  f"in {settings.prefect_auth_file})\nS3 endpoint:     {settings.s3_endpoint}")


@stack_app.command("down")
def stack_down() -> None:
    """Stop every serving instance and what `stack up` started, by recorded pid."""
    from modelops.regions import load_regions
    from modelops_cli.local_stack import daemons
    from modelops_cli.regions import regions_down

    settings = load_settings()
    ds = daemons(settings)
    try:  # the other regions first: their workers and instances
        plan = load_regions(settings)
    except ModelopsError as e:
        err.print(f"warning: {e}; stopping the regions `modelops up` started")
        plan = None
    regions_down(settings, plan)
    _stop_serving(settings, ds, ("prefect-worker", "batch-api", "autoscaler"))
    for name, d in reversed(list(ds.items())):
        # The worker and the autoscaler were stopped first; s3 writes what changed since its last save before it exits.
        if name not in ("prefect-worker", "autoscaler", "batch-api"):
            console.print(f"{name}: {'stopped' if d.stop(timeout=300 if name == 's3' else 20) else 'was not running'}")


@stack_app.command("region-up", hidden=True)
def region_up() -> None:
    """Start this region's router, worker and autoscaler, and serve again what it stopped (run by
    `modelops up` with the region's environment: modelops_cli/regions.py)."""
    from modelops_cli.local_stack import daemons
    from tasks.restore import restore_stopped
    from tasks.traffic.haproxy import HAProxyRouter
    from tasks.traffic.interface import routes_from_registry

    settings = load_settings()
    ds = daemons(settings)
    try:
        router = HAProxyRouter(settings)
        was = router.pid()
        router.ensure_running(routes_from_registry(Registry(settings.registry)))
        console.print(f"haproxy: {'already running' if was else 'started'} (pid {router.pid()}, {settings.router_url})")
        restore_stopped(settings, say=console.print)
        for name in ("prefect-worker", "autoscaler"):
            started = ds[name].start()
            console.print(f"{name}: {'started' if started else 'already running'} (pid {ds[name].pid()})")
    except ModelopsError as e:
        fail(str(e))


@stack_app.command("region-down", hidden=True)
def region_down() -> None:
    """Stop this region's worker, flow runs, autoscaler, instances and router (run by
    `modelops down` with the region's environment)."""
    from modelops_cli.local_stack import daemons

    settings = load_settings()
    _stop_serving(settings, daemons(settings), ("prefect-worker", "autoscaler"))


def _stop_serving(settings: Settings, ds: dict, first: tuple[str, ...]) -> None:
    """Stop the daemons ``first`` (what would start work), the flow runs, every instance, then
    HAProxy: the serving side of a stack or of a region, in that order."""
    from modelops.process import stop_process_group
    from modelops_cli.local_stack import flow_run_processes
    from tasks.restore import stop_serving_instances
    from tasks.traffic.haproxy import HAProxyRouter

    # The worker first: a rollout must not see its instances go and react (roll back, scale up
    # again). The batch API's sweep would start flow runs for batches whose runner stopped; the
    # autoscaler would start instances again as they go (a scale action in flight finishes or is
    # cut at its 60 s grace; its instances are stopped below with the others).
    for name in first:
        stopped = ds[name].stop(timeout=60 if name == "autoscaler" else 20)
        console.print(f"{name}: {'stopped' if stopped else 'was not running'}")
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
