"""Experiments on a model's live traffic (:mod:`modelops.experiments`): start, compare, stop.

Start and stop change routes under the model's rollout lock, so an experiment and a rollout (or
promote, rollback) never move the same model's traffic at once; while an experiment runs, the
lock refuses them (:func:`tasks.lock.rollout_lock`). Each arm is measured from its version's
instances (vLLM's and Triton's counters, since the experiment started: a baseline is read at
start) and from the router (the requests the experiment sent it, by key or to the default arm).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import httpx

from modelops.errors import TrafficError
from modelops.experiments import ExperimentSpec
from modelops.histograms import quantile_interval, wilson_interval
from modelops.registry import Experiment, Registry
from tasks.traffic.gates import Snapshot, parse_prometheus, snapshot
from tasks.traffic.interface import Router, commit_routes

__all__ = ["ArmStats", "compare_arms", "experiment_markdown", "publish_experiment_report", "router_metrics_text",
           "start_experiment", "stop_experiment"]


def _version_snapshot(registry: Registry, model_id: str, version: str, client: httpx.Client) -> Snapshot:
    """The sum of the version's running instances' counters (an instance that does not answer
    counts nothing: its restart resets them anyway)."""
    total = Snapshot()
    for inst in registry.instances(model_id, version):
        if inst.state == "running" and (url := inst.endpoints.get("metrics")):
            try:
                total = total + snapshot(url, client)
            except httpx.HTTPError:
                continue
    return total


def start_experiment(registry: Registry, router: Router, model_id: str, spec: ExperimentSpec) -> Experiment:
    """Record the experiment with each arm's baseline and route by it, under the rollout lock.

    Raises:
        ValueError: one runs on the model already, or an arm is the model's running shadow.
        TrafficError: the router cannot split by key (the Gateway API one), a rollout holds the
            model, or the router refused the routes (then nothing was kept).
    """
    from tasks.lock import rollout_lock

    if (shadow := registry.shadow(model_id)) is not None and shadow.version in {a.version for a in spec.arms}:
        raise ValueError(f"version {shadow.version} of {model_id} is a shadow (copies of {shadow.percent} % of its "
                         f"requests, never served): `modelops shadow stop {model_id}` first, or leave it out of the arms")
    if not router.experiments:
        raise TrafficError(f"the {type(router).__name__} does not split traffic by key: experiments run on the local "
                           "HAProxy router only (MODELOPS_ROUTER=haproxy) for now")
    with rollout_lock(model_id, holder=f"modelops experiment start (pid {os.getpid()})", wait_s=60,
                      experiment_ok=True), httpx.Client() as client:
        baseline = {a.version: _version_snapshot(registry, model_id, a.version, client).to_json()
                    for a in spec.arms}
        row = registry.start_experiment(model_id, spec, baseline_json=json.dumps(baseline))
        try:
            commit_routes(registry, router)
        except Exception:
            registry.discard_experiment(row.id)
            raise
    return row


def stop_experiment(registry: Registry, router: Router, model_id: str, keep: str) -> tuple[Experiment, dict | None]:
    """End the model's experiment keeping version ``keep``: it becomes the default (weight 100)
    and the other arms are draining (serving pinned requests until cleanup retires them), with
    the reason, under the lock. Returns the experiment and what the promotion of ``keep`` did
    (:func:`tasks.traffic.promote.promote`'s result; None when it was the default already).

    Raises:
        KeyError: no experiment runs on the model.
        ValueError: ``keep`` is not one of its arms.
        TrafficError: a rollout holds the model, or the router refused the routes.
    """
    from tasks.lock import rollout_lock
    from tasks.traffic.promote import promote

    running = registry.experiment(model_id)
    if running is None:
        raise KeyError(f"no experiment runs on {model_id} (`modelops experiment status`)")
    arms = [a.version for a in running.spec().arms]
    if keep not in arms:
        raise ValueError(f"--keep: {keep!r} is not an arm of the experiment on {model_id} (arms: {', '.join(arms)})")
    with rollout_lock(model_id, holder=f"modelops experiment stop (pid {os.getpid()})", wait_s=60,
                      experiment_ok=True):
        row = registry.stop_experiment(model_id, keep)
        why = f"the experiment on {model_id} ended keeping {keep}"
        # The other arms step down as a replaced default does: draining, pinned requests only,
        # until cleanup retires them.
        for version in arms:
            if version != keep and (v := registry.get_version(model_id, version)) and v.state == "serving" \
                    and v.weight == 0:
                registry.set_state(model_id, version, "draining", why)
        promoted = None
        if registry.get_version(model_id, keep).weight != 100:
            promoted = promote(model_id, keep, registry, router, reason=why)
        else:  # the default already: only the experiment's rules go
            commit_routes(registry, router)
    return row, promoted


@dataclass(frozen=True)
class ArmStats:
    """One arm since the experiment started: ``requests`` the router sent it by key and to it
    as the default arm; the version's ``answered`` and ``failed`` requests (all of its
    traffic, pinned included) with the failure rate's 95 % Wilson interval; TTFT p50/p90 and
    inter-token latency p90 as (low, estimate, high) 95 % intervals in seconds (None: no data);
    the tokens its engines took in (``prompt_tokens``) and generated (``generation_tokens``)."""

    version: str
    percent: int
    by_key: int
    by_default: int
    answered: int
    failed: int
    error_rate: tuple[float, float, float]
    ttft_p50: tuple[float, float, float] | None
    ttft_p90: tuple[float, float, float] | None
    itl_p90: tuple[float, float, float] | None
    prompt_tokens: int = 0
    generation_tokens: int = 0


def compare_arms(registry: Registry, experiment: Experiment, router_metrics: str) -> list[ArmStats]:
    """Each arm's :class:`ArmStats` from its instances now (less the baseline) and the router's
    ``/metrics`` text (its ``modelops_router_experiment_requests_total``)."""
    assigned: dict[tuple[str, str], float] = {}
    for labels, value in parse_prometheus(router_metrics).get("modelops_router_experiment_requests_total", []):
        if labels.get("model") == experiment.model_id:
            k = (labels.get("version", ""), labels.get("assigned", ""))
            assigned[k] = assigned.get(k, 0.0) + value
    baseline = json.loads(experiment.baseline_json or "{}")
    out = []
    with httpx.Client() as client:
        for arm in experiment.spec().arms:
            now = _version_snapshot(registry, experiment.model_id, arm.version, client)
            d = now - Snapshot.from_json(baseline[arm.version]) if arm.version in baseline else now
            n = d.success + d.failure
            low, high = wilson_interval(d.failure, n)
            out.append(ArmStats(arm.version, arm.percent, int(assigned.get((arm.version, "key"), 0)),
                                int(assigned.get((arm.version, "default"), 0)), int(n), int(d.failure),
                                (low, d.failure / n if n else 0.0, high), quantile_interval(0.5, d.ttft_buckets),
                                quantile_interval(0.9, d.ttft_buckets), quantile_interval(0.9, d.itl_buckets),
                                int(d.prompt_tokens), int(d.generation_tokens)))
    return out


def router_metrics_text(settings) -> str:
    """The router's counts of the running experiments' requests since each started
    (:meth:`tasks.traffic.interface.Router.experiment_metrics`)."""
    from tasks import backends

    return backends.router(settings).experiment_metrics()



def experiment_markdown(experiment: Experiment, arms: list[ArmStats]) -> str:
    """The arms' comparison as a Markdown report (what :func:`compare_arms` measured)."""
    def ci(x, scale: float = 1000.0, unit: str = " ms") -> str:
        return "-" if x is None else f"{x[1] * scale:.1f} [{x[0] * scale:.1f}, {x[2] * scale:.1f}]{unit}"

    spec = experiment.spec()
    out = [f"# Experiment on {experiment.model_id}",
           f"Arms by {spec.key}, default {spec.default}; started {experiment.started_at:%Y-%m-%d %H:%M:%S} UTC" +
           (f", stopped {experiment.stopped_at:%H:%M:%S} keeping {experiment.kept}" if experiment.stopped_at else "") +
           ". Intervals: 95 %.", "",
           "| arm | share | by key | to default | answered | failed | error rate | TTFT p50 | TTFT p90 | ITL p90 | "
           "prompt tokens | generated tokens |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {a.version} | {a.percent} % | {a.by_key} | {a.by_default} | {a.answered} | {a.failed} | "
            f"{ci(a.error_rate, 100, ' %')} | {ci(a.ttft_p50)} | {ci(a.ttft_p90)} | {ci(a.itl_p90)} | "
            f"{a.prompt_tokens} | {a.generation_tokens} |" for a in arms]
    return "\n".join(out) + "\n"


def publish_experiment_report(experiment: Experiment, arms: list[ArmStats]) -> str | None:
    """Publish :func:`experiment_markdown` as the Prefect artifact ``experiment-<model_id>``; its
    key, or None when Prefect could not take it (best effort)."""
    from tasks.observe import publish_markdown

    return publish_markdown(f"experiment-{experiment.model_id}", experiment_markdown(experiment, arms),
                            f"experiment on {experiment.model_id}")
