"""Regions on the local stack: ``modelops up --regions N`` writes a regions file, ``up``/``down``
start and stop each region's own processes, and ``modelops regions check|ls``.

A region other than the stack itself gets, on this machine: its work pool and a process worker,
its HAProxy router on its own ports, its autoscaler, its own home (registry, FSx root,
instances); it shares the stack's Prefect server (and auth string) and S3. Its processes are
started by ``modelops stack region-up`` run with the region's environment, so every setting
they read is the region's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import typer
import yaml

from modelops.errors import ModelopsError
from modelops.regions import Region, RegionPlan, RegionsError, load_regions, region_env, region_settings
from modelops.settings import REPO_ROOT, Settings
from modelops_cli.app import app
from modelops_cli.output import console, err, examples, fail, json_option, load_settings, print_json, print_table

__all__ = ["other_regions", "print_regions_status", "regions_down", "regions_status", "regions_up",
           "write_local_regions"]

regions_app = typer.Typer(help="Regions: work pools, routers and homes of a multi-region stack (docs/regions.md).",
                          no_args_is_help=True)
app.add_typer(regions_app, name="regions")
_BIN = Path(sys.executable).parent


def write_local_regions(settings: Settings, count: int) -> Path:
    """Write ``settings.regions_path`` for ``count`` regions on this machine (``count`` 1: none, and
    none may exist): ``region-1`` is the stack itself; ``region-K`` has the work pool ``<work_pool>-region-K``, the home
    ``<home>/regions/region-K`` and router ports 100 × (K − 1) above the stack's.

    Raises:
        ModelopsError: a different regions file exists already (it is never overwritten)."""
    regions = [{"name": "region-1", "work_pool": settings.work_pool}]
    for k in range(2, count + 1):
        regions.append({"name": f"region-{k}", "work_pool": f"{settings.work_pool}-region-{k}", "settings": {
            "home": str(settings.home_dir / "regions" / f"region-{k}"),
            "router_port": settings.router_port + 100 * (k - 1),
            "router_grpc_port": settings.router_grpc_port + 100 * (k - 1)}})
    text = "# Written by `modelops up --regions N` (modelops/regions.py says what each field means).\n" + \
        yaml.safe_dump({"regions": regions}, sort_keys=False)
    path = settings.regions_path
    if count == 1:  # one region: the stack itself, which needs no file
        if path.exists():
            raise ModelopsError(f"{path} exists: remove it for one region (`modelops down` first stops the others)")
        return path
    if path.exists():
        if path.read_text() == text:
            return path
        raise ModelopsError(f"{path} exists and is not the {count}-region file `--regions {count}` would write: "
                            "edit it, or remove it first")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def other_regions(plan: RegionPlan | None, base: Settings) -> list[tuple[Region, Settings]]:
    """The regions that are not the stack itself (their own home), with their settings.

    Raises:
        RegionsError: a region shares the stack's home but not its work pool."""
    out = []
    for region in plan.regions if plan else []:
        rs = region_settings(region, base)
        if rs.home_dir == base.home_dir:
            if region.work_pool != base.work_pool:
                raise RegionsError(f"region {region.name} shares the stack's home but has the work pool "
                                   f"{region.work_pool}, not the stack's {base.work_pool}: give it settings.home")
            continue
        out.append((region, rs))
    return out


def _region_environ(base: Settings, region: Region, rs: Settings) -> dict[str, str]:
    from modelops_cli.local_stack import prefect_env, prefect_auth_string

    # The region's processes talk to the stack's Prefect server: its auth string, in the
    # region's own run folder too (everything there reads it from settings.prefect_auth_file).
    auth = prefect_auth_string(base)
    rs.prefect_auth_file.parent.mkdir(parents=True, exist_ok=True)
    if not rs.prefect_auth_file.exists() or rs.prefect_auth_file.read_text().strip() != auth:
        fd = os.open(rs.prefect_auth_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(auth)
    return {**prefect_env(base), **region_env(region), "MODELOPS_HOME": str(rs.home_dir)}


def _prefect(env: dict[str, str], *args: str) -> None:
    proc = subprocess.run([str(_BIN / "prefect"), *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelopsError(f"prefect {' '.join(args)} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")


def regions_up(base: Settings, plan: RegionPlan, say=console.print) -> None:
    """Create every region's work pool, deploy the regional flows for every region
    (tasks/regions.py), then start each other region's router, worker and autoscaler.

    Raises:
        ModelopsError: a Prefect command or a region's start failed (its output in the message)."""
    from modelops_cli.local_stack import prefect_env
    from tasks.regions import regional_deployments

    env = prefect_env(base)
    for region in plan.regions:
        if region.work_pool != base.work_pool:
            _prefect(env, "work-pool", "create", region.work_pool, "--type", "process", "--overwrite")
    spec = base.run_dir / "regions.prefect.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(yaml.safe_dump(regional_deployments(plan), sort_keys=False))
    _prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", str(spec))
    say(f"regions: {', '.join(r.name for r in plan.regions)} (deployments model-lifecycle, materialize-weights, "
        "bake-version, rollback per region; global-rollout takes announcements)")
    for region, rs in other_regions(plan, base):
        env = _region_environ(base, region, rs)
        _record(base, region.name, env)  # before it starts: `down` stops it even if the regions file goes
        proc = subprocess.run([str(_BIN / "modelops"), "stack", "region-up"], env=env,
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
        for line in proc.stdout.splitlines():
            say(f"{region.name}: {line}")
        if proc.returncode != 0:
            raise ModelopsError(f"region {region.name} did not start:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")


def _started_file(base: Settings) -> Path:
    return base.run_dir / "regions.started.json"


def _started(base: Settings) -> dict[str, dict[str, str]]:
    import json

    try:
        return json.loads(_started_file(base).read_text())
    except (OSError, ValueError):
        return {}


def _record(base: Settings, name: str, env: dict[str, str] | None) -> None:
    """Remember (``env``) or forget (None) a region this stack started, with the environment its
    processes got (mode 600: it holds the Prefect auth string)."""
    import json

    started = _started(base)
    if env is None:
        started.pop(name, None)
    else:
        started[name] = {k: v for k, v in env.items() if k.startswith(("MODELOPS_", "PREFECT_"))}
    path = _started_file(base)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(started, f)


def regions_down(base: Settings, plan: RegionPlan | None, say=console.print) -> None:
    """Stop each other region's processes and instances (``modelops stack region-down`` in its
    environment): the regions of ``plan`` and every region ``up`` started and no ``down`` stopped
    since (so a regions file removed or broken meanwhile strands none). A region that fails to
    stop is reported and the rest go on."""
    todo = {name: {**os.environ, **env} for name, env in _started(base).items()}
    try:
        planned = other_regions(plan, base)
    except RegionsError as e:
        err.print(f"warning: {e}; stopping the regions `modelops up` started")
        planned = []
    todo.update({region.name: _region_environ(base, region, rs) for region, rs in planned})
    for name, env in todo.items():
        proc = subprocess.run([str(_BIN / "modelops"), "stack", "region-down"], env=env,
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
        for line in proc.stdout.splitlines():
            say(f"{name}: {line}")
        if proc.returncode != 0:
            err.print(f"warning: region {name} did not stop cleanly:\n{proc.stderr[-1500:]}")
        else:
            _record(base, name, None)


@regions_app.command("check", epilog=examples("modelops regions check", "modelops regions check regions.yaml"))
def check(path: Path = typer.Argument(None, help="a regions file; default the stack's (MODELOPS_REGIONS_FILE or "
                                      "<home>/regions.yaml)")) -> None:
    """Check a regions file without changing anything: fields, waves, and that no two regions
    share a home, an FSx root or a router port. Exit 2 naming the field when it is wrong."""
    settings = load_settings()
    target = path or settings.regions_path
    if not target.is_file():
        fail(f"no regions file at {target}", 2)
    try:
        plan = load_regions(settings, target)
    except RegionsError as e:
        fail(str(e), 2)
    waves = " → ".join("[" + ", ".join(r.name for r in w) + "]" for w in plan.wave_plan())
    console.print(f"{target}: {len(plan.regions)} regions; waves {waves}; bake {plan.bake_s:g} s; "
                  f"on_failure {plan.on_failure}")


@regions_app.command("ls", epilog=examples("modelops regions ls", "modelops regions ls --json"))
def ls(as_json: bool = json_option("print JSON")) -> None:
    """The regions: work pool, router, home and FSx root of each."""
    from rich.table import Table

    settings = load_settings()
    try:
        plan = load_regions(settings)
    except RegionsError as e:
        fail(str(e), 2)
    rows = []
    for region in plan.regions if plan else [Region(name="local", work_pool=settings.work_pool)]:
        rs = region_settings(region, settings)
        rows.append({"region": region.name, "work_pool": region.work_pool, "router": rs.router_url,
                     "home": str(rs.home_dir), "fsx_root": str(rs.fsx_dir)})
    if as_json:
        print_json({"regions_file": str(settings.regions_path) if plan else None, "regions": rows})
        return
    table = Table("region", "work pool", "router", "home", "FSx root")
    for r in rows:
        table.add_row(r["region"], r["work_pool"], r["router"], r["home"], r["fsx_root"])
    print_table(table)


def regions_status(settings: Settings) -> dict[str, list[dict]] | None:
    """Each region's versions (not retired), from the region's own registry: ``{region: [{model_id,
    version, state, weight, instances}]}``; None without a regions file.

    Raises:
        RegionsError: the regions file is invalid."""
    from modelops.registry import Registry

    plan = load_regions(settings)
    if plan is None:
        return None
    out: dict[str, list[dict]] = {}
    for region in plan.regions:
        rs = region_settings(region, settings)
        path = Path(rs.registry.removeprefix("sqlite:///"))
        if rs.registry.startswith("sqlite:///") and not path.exists():
            out[region.name] = []
            continue
        out[region.name] = [{"model_id": m["model_id"], "version": v["version"], "state": v["state"],
                             "weight": v["weight"], "instances": len(v["instances"])}
                            for m in Registry(rs.registry).status()["models"] for v in m["versions"]
                            if v["state"] != "retired"]
    return out


def print_regions_status(regions: dict[str, list[dict]]) -> None:
    """The table ``modelops status`` prints below its own with a regions file: one row per
    region and version."""
    from rich.table import Table

    table = Table("region", "model", "version", "state", "weight", "instances")
    for region, rows in regions.items():
        for r in rows or [{"model_id": "-", "version": "-", "state": "-", "weight": "", "instances": ""}]:
            table.add_row(region, r["model_id"], r["version"], r["state"], str(r["weight"]), str(r["instances"]))
    print_table(table)


@regions_app.command("render", epilog=examples(
    "modelops regions render --pull-directory /opt/modelops > regions.prefect.yaml",
    "prefect --no-prompt deploy --all --prefect-file regions.prefect.yaml"))
def render(pull_directory: str = typer.Option("{{ $MODELOPS_REPO }}", help="where a region's worker finds the flows' "
                                              "code: /opt/modelops in the control-plane image (Kubernetes)")) -> None:
    """Print the prefect.yaml of every region's deployments (model-lifecycle, materialize-weights,
    bake-version and rollback per region, on the region's work pool, with its settings and job
    variables), for `prefect deploy --all --prefect-file`. `modelops up` deploys the same file for
    local regions itself."""
    from tasks.regions import regional_deployments

    settings = load_settings()
    try:
        plan = load_regions(settings)
    except RegionsError as e:
        fail(str(e), 2)
    if plan is None:
        fail(f"no regions file at {settings.regions_path}", 2)
    print(yaml.safe_dump(regional_deployments(plan, pull_directory), sort_keys=False), end="")
