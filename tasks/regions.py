"""A global rollout's regional work: each region's flow runs go to its own Prefect work pool.

Every region has a deployment of each regional flow, named after the region
(``model-lifecycle/<region>``, ``materialize-weights/<region>``, ``bake-version/<region>``,
``rollback/<region>``; rendered by :func:`regional_deployments`, deployed by ``modelops up``
locally). A wave starts them with Prefect's ``run_deployment`` as child runs of the global
flow run, so the UI shows one parent with a child per region and wave.

A region whose worker is down never hangs a rollout: its run must start within the plan's
``region_start_timeout_s``, or it is cancelled and the region reported down.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from modelops.registry import Registry
from modelops.regions import Region, RegionPlan, RegionsError, load_regions, region_env, region_settings
from modelops.settings import REPO_ROOT, Settings, get_settings

__all__ = ["REGIONAL_FLOWS", "RegionRun", "check_region_deployments", "default_versions", "finished_regions",
           "load_plan", "region_run_task", "regional_deployments", "run_in_region"]

log = logging.getLogger(__name__)

# flow name → entrypoint of the flows each region runs on its own pool.
REGIONAL_FLOWS = {
    "model-lifecycle": "flows/lifecycle.py:model_lifecycle",
    "materialize-weights": "flows/regional.py:materialize_weights",
    "bake-version": "flows/regional.py:bake_version",
    "rollback": "flows/rollback.py:rollback_flow",
}
_FINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")


@dataclass(frozen=True)
class RegionRun:
    """What one regional flow run came to: ``state`` is Prefect's state type (``COMPLETED``,
    ``FAILED``, ``CRASHED``, ``CANCELLED``), or ``NOT_STARTED`` when no worker took it in time;
    ``seconds`` from its creation to its end."""

    region: str
    flow: str
    state: str
    message: str
    run_name: str = ""
    run_id: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED"

    def as_dict(self) -> dict:
        return asdict(self)


def load_plan(settings: Settings | None = None) -> RegionPlan:
    """The stack's regions file, checked.

    Raises:
        RegionsError: there is none (a global rollout needs one), or it is invalid."""
    settings = settings or get_settings()
    plan = load_regions(settings)
    if plan is None:
        raise RegionsError(f"no regions file at {settings.regions_path}: a global rollout needs one "
                           "(`modelops up --regions 2` writes one for two local regions; docs/regions.md)")
    return plan


def regional_deployments(plan: RegionPlan, pull_directory: str = "{{ $MODELOPS_REPO }}") -> dict:
    """A prefect.yaml (as a dict) with every regional flow's deployment for every region: the
    deployment is named after the region, goes to the region's work pool with the region's
    ``job_variables``, and its flow runs get the region's settings as ``MODELOPS_*`` variables
    in ``env`` (:func:`~modelops.regions.region_env`). ``pull_directory``: where the worker finds
    the flows' code (the checkout locally, ``/opt/modelops`` in the control-plane image).
    ``prefect deploy --all --prefect-file`` deploys it."""
    deployments = []
    for region in plan.regions:
        for flow, entrypoint in REGIONAL_FLOWS.items():
            deployments.append({
                "name": region.name, "entrypoint": entrypoint, "tags": ["modelops", f"region:{region.name}"],
                "description": f"{flow} in region {region.name} (started by a global-rollout flow run)",
                "work_pool": {"name": region.work_pool, "job_variables": {**region.job_variables, "env": {
                    **region.job_variables.get("env", {}), "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
                    **region_env(region)}}}})
    return {"name": "modelops-regions", "prefect-version": _prefect_version(), "build": None, "push": None,
            "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": pull_directory}}],
            "deployments": deployments}


def _prefect_version() -> str:
    import yaml

    return str(yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["prefect-version"])


def check_region_deployments(plan: RegionPlan) -> None:
    """Before any region changes: every region's work pool and regional deployments exist on the
    Prefect server.

    Raises:
        RegionsError: naming the unknown pool or missing deployment, and the fix."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for region in plan.regions:
            try:
                client.read_work_pool(region.work_pool)
            except ObjectNotFound:
                raise RegionsError(f"region {region.name}: work pool {region.work_pool!r} does not exist on the "
                                   "Prefect server: create it and start its worker (`modelops up` does both for "
                                   "local regions), or fix regions[].work_pool") from None
            for flow in REGIONAL_FLOWS:
                try:
                    client.read_deployment_by_name(f"{flow}/{region.name}")
                except ObjectNotFound:
                    raise RegionsError(f"region {region.name}: deployment {flow}/{region.name} does not exist: "
                                       "deploy the regions' flows (`modelops up` does)") from None


def run_in_region(plan: RegionPlan, region: Region, flow: str, parameters: dict, key: str = "") -> RegionRun:
    """Start ``flow``'s deployment of ``region`` and follow it to its end.

    Args:
        key: an idempotency key: a retried call with the same key follows the run it started
            instead of starting another.

    Returns:
        the run's end; ``NOT_STARTED`` (the run cancelled) when no worker of the region's pool
        took it within ``plan.region_start_timeout_s``; ``FAILED`` past ``plan.region_timeout_s``.
    """
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelled

    started = time.monotonic()
    what = parameters.get("manifest") or parameters
    label = f"{what.get('model_id', '')} {what.get('version') or what.get('to_version') or ''}".strip()
    run = run_deployment(f"{flow}/{region.name}", parameters=parameters, timeout=0, as_subflow=True,
                         idempotency_key=key or None, flow_run_name=f"{flow} of {label} [{region.name}]")
    name = run.name
    log.info("region %s: %s flow run %s created", region.name, flow, name)
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(run.id)
            kind = run.state.type.value if run.state else "SCHEDULED"
            waited = time.monotonic() - started
            if kind in _FINAL:
                message = (run.state.message or run.state.name or kind) if run.state else kind
                return RegionRun(region.name, flow, kind, message, name, str(run.id), round(waited, 1))
            # PENDING: a worker took it and is starting its process (slow on a loaded node, never
            # a sign of a dead worker); SCHEDULED (Late included): no worker has taken it.
            if kind == "SCHEDULED" and waited > plan.region_start_timeout_s:
                why = (f"no worker of work pool {region.work_pool} took flow run {name} within "
                       f"{plan.region_start_timeout_s:g} s (region_start_timeout_s): is the region's worker down?")
                client.set_flow_run_state(run.id, Cancelled(message=why), force=True)
                return RegionRun(region.name, flow, "NOT_STARTED", why, name, str(run.id), round(waited, 1))
            if waited > plan.region_timeout_s:
                return RegionRun(region.name, flow, "FAILED", f"flow run {name} still {kind.lower()} after "
                                 f"{plan.region_timeout_s:g} s (region_timeout_s)", name, str(run.id), round(waited, 1))
            time.sleep(2)


@task(name="region_run", task_run_name="{region_name}: {flow}", retries=0, tags=["modelops"],
      cache_policy=NO_CACHE)
def region_run_task(plan: RegionPlan, region_name: str, flow: str, parameters: dict, key: str = "") -> RegionRun:
    """Prefect task around :func:`run_in_region`, on the plan the global run read once (no
    retries of its own: the regional flows resume themselves when run again)."""
    return run_in_region(plan, plan.region(region_name), flow, parameters, key)


def finished_regions(plan: RegionPlan, manifest, base: Settings | None = None) -> set[str]:
    """The regions whose registry says ``manifest``'s rollout finished there
    (:func:`tasks.validate.rollout_finished`): a global rollout announced again skips them."""
    from tasks.validate import rollout_finished

    base = base or get_settings()
    done = set()
    for region in plan.regions:
        settings = region_settings(region, base)
        if _registry_exists(settings) and rollout_finished(Registry(settings.registry), manifest):
            done.add(region.name)
    return done


def _registry_exists(settings: Settings) -> bool:
    # A region that never ran a flow has no SQLite file yet; opening one would create it here.
    return not settings.registry.startswith("sqlite:///") or Path(settings.registry.removeprefix("sqlite:///")).exists()


def default_versions(plan: RegionPlan, model_id: str, base: Settings | None = None) -> dict[str, str | None]:
    """Each region's default version of ``model_id`` (the serving one with the most weight), from
    the region's own registry; None where it serves none: ``{region: version or None}``."""
    base = base or get_settings()
    out: dict[str, str | None] = {}
    for region in plan.regions:
        settings = region_settings(region, base)
        rows = [v for v in Registry(settings.registry).versions(model_id) if v.state == "serving" and v.weight > 0] \
            if _registry_exists(settings) else []
        out[region.name] = max(rows, key=lambda v: v.weight).version if rows else None
    return out
