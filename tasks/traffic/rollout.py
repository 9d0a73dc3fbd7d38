"""Red-black rollout: shift traffic in steps with metric gates; roll back atomically on failure.

The new version is already provisioned and health-checked beside the old one. For each step
(default 10 → 25 → 50 → 100 percent to the new version):

1. set the router weights (HAProxy runtime API, no reload); the registry records them first;
2. scale instances in the same proportion (``instances_for``; never below what the weights need);
3. watch a window of metrics (:mod:`tasks.traffic.gates`); a failed gate, a dead instance, a
   provider or router error, or the rollout's deadline rolls back. A window that brought the new
   version too few requests to judge (``gate_require_requests``) is never passed blindly unless
   asked: by default the gate sends its own requests through the router, pinned to the new
   version, and judges those (``gate_no_traffic``: probe, wait, fail or pass).

A replaced version at zero instances (``scaling.min: 0``, idle) has no capacity to keep: it is
never scaled, and when every replaced version is at zero the shift is one gated step to 100.

With the manifest's ``shadow:`` (:class:`modelops.shadow.ShadowPhase`) a shadow step comes first:
the new version gets copies of live requests, their answers are compared with the served ones,
and a failed comparison rolls back before any client was served by the new version.

Rollback is one router call: the old version's weight back to 100 and the new one's to 0. Then
the new version is drained (SIGTERM: readiness false, in-flight finished) and removed, and the
registry records the failed rollout and why. On success the old version is left draining at weight
0 with its instances; once the lifecycle's transaction commits, :func:`~tasks.traffic.retire.retire_replaced`
drains and removes it, and until then :func:`~tasks.traffic.undo.restore_traffic` can still put it back.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE

from modelops.artifacts import sealed_package
from modelops.errors import TrafficError
from modelops.registry import LIVE_INSTANCE_STATES, Registry
from modelops.settings import Settings
from tasks import backends
from tasks.health import probe_version
from tasks.traffic.gates import GateResult, Snapshot, evaluate, snapshot
from tasks.traffic.interface import Router, commit_routes
from tasks.traffic.undo import restore_traffic, snapshot_traffic

__all__ = ["RolloutFailed", "RolloutReport", "bake", "instances_for", "red_black", "rollout_task", "rollout_task_fn"]

log = logging.getLogger(__name__)


def instances_for(weight: int, baseline: int) -> int:
    """Instances a version needs to carry ``weight`` percent of what ``baseline`` instances
    carried at 100: ``ceil(baseline × weight / 100)``, at least 1 while the weight is above 0."""
    return 0 if weight <= 0 else max(1, math.ceil(baseline * weight / 100))


class RolloutFailed(TrafficError):
    """A red-black rollout was rolled back; ``report`` says where and why."""

    def __init__(self, message: str, report: "RolloutReport") -> None:
        super().__init__(message, report)  # both in args: Prefect pickles task exceptions
        self.report = report

    def __str__(self) -> str:
        return self.args[0]


@dataclass
class RolloutReport:
    """What a red-black rollout did: steps with their gates, the outcome and its timings (s)."""

    model_id: str
    new: str
    old: list[str]
    steps: list[dict] = field(default_factory=list)
    outcome: str = "running"
    reason: str = ""
    seconds: float = 0.0
    rollback_s: float | None = None  # from the failure to weights restored at the router

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def _metrics_urls(registry: Registry, model_id: str, version: str) -> dict[str, str]:
    # A restarting instance is read too: it does not answer, which fails the gate (its engine died).
    return {i.name: i.endpoints["metrics"] for i in registry.instances(model_id, version)
            if i.state in LIVE_INSTANCE_STATES and "metrics" in i.endpoints}


def red_black(model_id: str, new: str, registry: Registry, router: Router, settings: Settings, *,
              drain_and_stop, is_alive, scale=None, steps: list[int] | None = None, on_step=None) -> RolloutReport:
    """Shift ``model_id`` from its serving versions to ``new`` in steps; roll back on failure.

    Args:
        drain_and_stop: ``callable(instance name)``: drains one instance (SIGTERM, in-flight
            finished) and removes it (the provider's).
        is_alive: ``callable(instance row) -> bool``, polled during each gate window (the
            provider's :meth:`~tasks.provision.interface.Provider.is_alive`).
        scale: optional ``callable(version, count)`` that brings a version to ``count`` running
            instances (the provider's); None keeps the instance counts.
        steps: percentages for the new version, ending at 100 (default: settings).
        on_step: optional ``callable(percent)`` told the new version's weight after each step
            held (and 0 after a rollback).

    Returns:
        The report, ``outcome == "completed"``. The replaced versions are left draining at
        weight 0 with their instances; :func:`~tasks.traffic.retire.retire_replaced` removes them.

    Raises:
        RolloutFailed: after the rollback, with the report (``outcome == "rolled-back"``).
    """
    steps = steps or list(settings.redblack_steps)
    if not steps or steps[-1] != 100 or steps != sorted(steps):
        raise ValueError(f"red-black steps must rise to 100, got {steps}")
    t0 = time.monotonic()
    # The versions that carry the model's unpinned traffic; a versioned deployment at weight 0
    # (pinned requests only) is no part of the shift: its weight and instances stay as they are.
    old = [v.version for v in registry.versions(model_id) if v.state == "serving" and v.version != new and v.weight > 0]
    report = RolloutReport(model_id, new, old)
    counts = {v: len(registry.instances(model_id, v)) for v in old}
    baseline = sum(counts.values()) or 1
    if old and not any(counts.values()):
        steps = [100]  # nothing serves the old versions (scaled to zero): no fleet to shift from gradually
    sized = [v for v in old if counts[v]]  # a version at zero stays there (its requests are held meanwhile)
    deadline = t0 + settings.rollout_timeout_s
    client = httpx.Client()
    row = registry.get_version(model_id, new)
    phase = row.manifest.shadow if row is not None and any(counts.values()) else None
    try:
        for pct in (["shadow"] if phase else []) + steps:
            step: dict = {"weight": 0 if pct == "shadow" else pct}
            report.steps.append(step)
            try:
                if pct == "shadow":  # copies compared before any traffic moves
                    step["phase"] = "shadow"
                    gate = _shadow_gate(registry, router, settings, model_id, new, phase, is_alive, deadline)
                    step["gate"] = gate
                    if not gate["passed"]:
                        raise TrafficError(f"shadow: {gate['reason']}")
                    continue
                if scale is not None:
                    scale(new, instances_for(pct, baseline))  # up before the weights move
                weights = {new: pct, **{v: 100 - pct for v in old}}
                registry.set_weights(model_id, weights)
                commit_routes(registry, router)
                log.info("red-black %s: %d%% to %s", model_id, pct, new)
                gate = _gate(client, registry, router, settings, model_id, new, old, is_alive, deadline)
                step["gate"] = gate.as_dict()
                if not gate.passed:
                    raise TrafficError(f"gate at {pct}%: {gate.reason}")
                if time.monotonic() > deadline:
                    raise TrafficError(f"rollout exceeded rollout_timeout_s={settings.rollout_timeout_s:.0f}")
                if on_step is not None:
                    on_step(pct)
                if scale is not None and pct < 100:
                    # Down only once the step held: a rollback must find the old fleet able to
                    # carry what it carried before this step.
                    for v in sized:
                        scale(v, instances_for(100 - pct, baseline))
            except Exception as e:  # any failure at any step: roll back
                try:
                    _rollback(report, registry, router, model_id, new, old, str(e), drain_and_stop)
                    if scale is not None:
                        for v in sized:  # back to the capacity it had before the rollout
                            scale(v, counts[v])
                except Exception as rb:
                    report.outcome, report.reason = "rollback-failed", f"{e}; rollback failed: {rb}"
                    log.error("red-black %s: rollback failed: %s", model_id, rb)
                if on_step is not None:
                    on_step(0)
                at = "its shadow step" if pct == "shadow" else f"{pct}%"
                raise RolloutFailed(f"red-black of {model_id} {new} rolled back at {at} (weights restored in "
                                    f"{report.rollback_s} s): {report.reason or e}", report) from e
    finally:
        client.close()
    # The old versions take nothing now. They keep their instances until the rollout commits
    # (tasks.traffic.retire), so a later failure in the same transaction can still restore them.
    for v in old:
        registry.set_state(model_id, v, "draining", f"replaced by {new} (red-black)")
    commit_routes(registry, router)
    report.outcome, report.seconds = "completed", round(time.monotonic() - t0, 2)
    return report


def _watch(registry: Registry, model_id: str, new: str, seconds: float, is_alive) -> None:
    """Wait ``seconds``; a dead instance of the new version fails the gate at once, not at the
    window's end."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))
        for inst in registry.instances(model_id, new):
            if inst.state in ("restarting", "failed"):  # its supervisor saw the runtime die
                raise TrafficError(f"instance {inst.name} of {new} died: {inst.last_exit}")
            if inst.state == "running" and not is_alive(inst):
                raise TrafficError(f"instance {inst.name} of {new} exited")


class _Window:
    """A gate window from now: the new and old versions' counters (each live instance's
    ``/metrics``) and the router's 5xx per server (when it counts them) at its start; judged at
    any later moment against them."""

    def __init__(self, client: httpx.Client, registry: Registry, router: Router, model_id: str, new: str,
                 old: list[str]) -> None:
        self.client, self.registry, self.router, self.model_id, self.new = client, registry, router, model_id, new
        self.new_urls = _metrics_urls(registry, model_id, new)
        self.old_urls = {n: u for v in old for n, u in _metrics_urls(registry, model_id, v).items()}
        self.t0 = time.monotonic()
        self.errors0 = router.server_errors(model_id)
        self.new0, self.old0 = self._read(self.new_urls), self._read(self.old_urls)

    def _read(self, urls: dict[str, str]) -> Snapshot:
        out = []
        for name, url in urls.items():
            try:
                out.append(snapshot(url, self.client))
            except httpx.HTTPError as e:
                raise TrafficError(f"instance {name} stopped answering /metrics: {e}") from None
        return sum(out, Snapshot())

    def watch(self, seconds: float, is_alive) -> None:
        """Wait ``seconds`` (:func:`_watch`)."""
        _watch(self.registry, self.model_id, self.new, seconds, is_alive)

    def judge(self, settings: Settings, judged: str = "traffic") -> GateResult:
        """The verdict on everything since the window began (counter deltas)."""
        new1, old1 = self._read(self.new_urls), self._read(self.old_urls)
        errors1 = self.router.server_errors(self.model_id)
        router_5xx = None if self.errors0 is None or errors1 is None else \
            sum(errors1.get(s, 0) - self.errors0.get(s, 0) for s in self.new_urls)
        return evaluate(new1 - self.new0, old1 - self.old0, router_5xx, max_error_ratio=settings.gate_max_error_ratio,
                        max_p99_ratio=settings.gate_max_p99_ratio, min_requests=settings.gate_min_requests,
                        judged=judged, max_ttft_p90_ratio=settings.gate_max_ttft_p90_ratio,
                        max_itl_p90_ratio=settings.gate_max_itl_p90_ratio)


def bake(model_id: str, version: str, seconds: float, settings: Settings | None = None) -> GateResult:
    """Watch a version that serves already for ``seconds`` (a global rollout's bake after each
    wave, flows/global_rollout.py): every live instance must stay up and answer its ``/metrics``,
    and the version's error ratio over the window (instances' counters and the router's 5xx)
    must stay within ``gate_max_error_ratio``. Latency is not judged: no older version serves
    beside it to compare with.

    Raises:
        TrafficError: the version does not serve here, or an instance died or stopped answering.
    """
    from modelops.settings import get_settings

    settings = settings or get_settings()
    registry, router, provider = backends.parts(settings)
    row = registry.get_version(model_id, version)
    if row is None or row.state != "serving" or not _metrics_urls(registry, model_id, version):
        raise TrafficError(f"{model_id} {version} does not serve here ({row.state if row else 'never announced'}): "
                           "nothing to bake")
    with httpx.Client() as client:
        window = _Window(client, registry, router, model_id, version, [])
        window.watch(seconds, provider.is_alive)
        return window.judge(settings, judged=f"bake of {seconds:g} s")


def _gate(client: httpx.Client, registry: Registry, router: Router, settings: Settings, model_id: str, new: str,
          old: list[str], is_alive, deadline: float) -> GateResult:
    """One step's gate: a window of ``gate_window_s``; when it brought the new version fewer than
    ``gate_require_requests`` requests, ``gate_no_traffic`` decides, and the result's ``judged``
    says what was judged (never a silent pass on nothing)."""
    window = _Window(client, registry, router, model_id, new, old)
    window.watch(settings.gate_window_s, is_alive)
    gate = window.judge(settings)
    need, policy = settings.gate_require_requests, settings.gate_no_traffic
    if not gate.passed or gate.requests_new >= need:
        return gate
    too_few = f"{gate.requests_new} requests reached the new version in the window, fewer than gate_require_requests"
    if policy == "pass":
        return replace(gate, judged="nothing to judge, gate_no_traffic=pass")
    if policy == "fail":
        return replace(gate, passed=False, reason=f"{too_few} ({need}): nothing to judge (gate_no_traffic=fail)")
    if policy == "wait":
        while gate.passed and gate.requests_new < need:
            if time.monotonic() + settings.gate_window_s > deadline:
                return replace(gate, passed=False, reason=f"waited {time.monotonic() - window.t0:.0f} s and "
                               f"{gate.requests_new} requests reached the new version, fewer than "
                               f"gate_require_requests ({need}), within rollout_timeout_s (gate_no_traffic=wait)")
            window.watch(settings.gate_window_s, is_alive)
            gate = window.judge(settings, judged=f"traffic after waiting {time.monotonic() - window.t0:.0f} s")
        return gate
    # probe: the gate's own requests, through the router and pinned to the new version.
    row = registry.get_version(model_id, new)
    manifest = row.manifest if row is not None else None
    task = manifest.task if manifest is not None else "generate"
    kserve = manifest is not None and manifest.execution_mode == "separate"
    # Enough for the window's minimum, and at least one per live instance of the new version (each
    # probe carries its own session key, so the router spreads them as it spreads clients').
    count = max(settings.gate_probe_requests, need, len(window.new_urls))
    window = _Window(client, registry, router, model_id, new, old)
    problems = probe_version(model_id, new, task, kserve, count)
    gate = window.judge(settings, judged=f"probe: {count} requests of its own")
    if problems and gate.passed:
        gate = replace(gate, passed=False, reason=f"probe: {len(problems)} of {count} requests failed, e.g. "
                                                  f"{problems[0]}")
    return gate


def _shadow_gate(registry: Registry, router: Router, settings: Settings, model_id: str, new: str, phase, is_alive,
                 deadline: float) -> dict:
    """The shadow step (the manifest's ``shadow:``, :class:`modelops.shadow.ShadowPhase`): the new
    version gets copies of ``phase.percent`` % of the unpinned requests for ``phase.window_s``
    (then more windows while fewer than ``gate_require_requests`` copies were answered, until the
    deadline), the comparison is judged and published (artifact ``shadow-<model_id>``), and the
    copies stop. Returns a gate dict as :func:`_gates_table` shows it."""
    from tasks.traffic.shadow import compare_shadow, judge_shadow, publish_shadow_report, start_shadow, stop_shadow

    shadow = start_shadow(registry, router, model_id, new, phase.percent, origin="red-black", lock=False)
    t0 = time.monotonic()
    try:
        _watch(registry, model_id, new, phase.window_s, is_alive)
        stats = compare_shadow(registry, shadow)
        while stats.compared + stats.shadow_failed < settings.gate_require_requests and \
                time.monotonic() + phase.window_s < deadline:
            _watch(registry, model_id, new, phase.window_s, is_alive)
            stats = compare_shadow(registry, shadow)
        waited = time.monotonic() - t0
    finally:
        shadow = stop_shadow(registry, router, model_id, lock=False)
    reason = judge_shadow(stats, max_failure_ratio=settings.gate_max_error_ratio, min_equal=phase.min_greedy_equal,
                          min_cosine=phase.min_cosine)
    publish_shadow_report(shadow, stats, f"failed: {reason}" if reason else "passed")
    log.info("red-black %s: shadow step on %s %s: %s", model_id, new, "failed" if reason else "passed",
             reason or stats.as_dict())
    sent = stats.compared + stats.shadow_failed
    judged = (f"shadow: {sent} copies in {waited:.0f} s" +
              (f", greedy equal {stats.equal}/{stats.greedy}" if stats.greedy else "") +
              (f", cosine min {stats.cosine_min:.6f}" if stats.cosine_min is not None else ""))
    return {"passed": reason is None, "reason": reason or "", "requests_new": sent, "errors_new": stats.shadow_failed,
            "judged": judged, "shadow": stats.as_dict()}


def _rollback(report: RolloutReport, registry: Registry, router: Router, model_id: str, new: str, old: list[str],
              reason: str, drain_and_stop) -> None:
    t = time.monotonic()
    # One weight-only router call (no reload): every unpinned request goes to the old version.
    registry.set_weights(model_id, {new: 0, **{v: 100 for v in old}})
    try:
        commit_routes(registry, router)
    except TrafficError as e:
        log.error("rollback: router refused the restored weights: %s", e)
        raise
    report.rollback_s = round(time.monotonic() - t, 3)
    report.outcome, report.reason = "rolled-back", reason
    log.warning("red-black %s: rolled back to %s in %.3f s: %s", model_id, old, report.rollback_s, reason)
    registry.set_state(model_id, new, "failed", f"red-black rolled back: {reason}")
    for inst in registry.instances(model_id, new):
        drain_and_stop(inst.name)
    commit_routes(registry, router)  # the failed version's servers leave the router


def rollout_task_fn(manifest, package=None, image=None, on_step=None) -> dict:
    """The traffic stage: first version, versioned route, or a red-black rollout with gates.

    Returns:
        ``{"strategy", "reason", "weights": {version: percent}, "replaced": [versions left
        draining for :func:`~tasks.traffic.retire.retire_replaced`], "rollout": report dict (red-black only)}``.
    """
    from modelops.settings import get_settings
    from tasks.traffic.shift import choose_strategy, shift_traffic

    settings = get_settings()
    registry, router, provider = backends.parts(settings)
    strategy, why = choose_strategy(manifest, registry)
    log.info("strategy for %s %s: %s (%s)", manifest.model_id, manifest.version, strategy, why)
    if strategy != "red-black":
        result = {**shift_traffic(manifest, registry), "reason": why, "replaced": []}
        if on_step is not None:
            on_step(result["weights"].get(manifest.version, 0))
        return result
    registry.set_strategy(manifest.model_id, manifest.version, strategy)
    registry.set_weights(manifest.model_id, {manifest.version: 0})
    registry.set_state(manifest.model_id, manifest.version, "serving")
    scale = None
    if package is not None and image is not None:
        def scale(version: str, count: int) -> None:
            pkg = package if version == manifest.version else sealed_package(settings, manifest.model_id, version)
            provider.scale(manifest.model_id, version, count, pkg, image,
                           unroute=lambda: commit_routes(registry, router))
    report = red_black(manifest.model_id, manifest.version, registry, router, settings,
                       drain_and_stop=provider.stop, is_alive=provider.is_alive, scale=scale, on_step=on_step)
    weights = {v.version: v.weight for v in registry.versions(manifest.model_id) if v.state == "serving"}
    return {"strategy": strategy, "reason": why, "weights": weights, "replaced": report.old,
            "rollout": report.as_dict()}


# No Prefect retries inside the lifecycle's transaction: a failed attempt rolls the whole
# transaction back at once (Prefect 3.9 Transaction.reset), even if a retry would succeed.
# NO_CACHE: a rollout is never skipped because an earlier run with the same inputs finished.
@task(name="shift_traffic", retries=0, timeout_seconds=1800, tags=["modelops"], cache_policy=NO_CACHE)
def rollout_task(manifest, package=None, image=None) -> dict:
    """Prefect task around :func:`rollout_task_fn`: red-black steps and gates in its log, the
    progress artifact ``traffic-<model_id>``. Inside a transaction, its ``on_rollback`` hook
    (:func:`restore_traffic`, then the replaced versions scaled back to their instance counts)
    undoes the change if a later stage of the transaction fails."""
    from prefect import get_run_logger
    from prefect.transactions import get_transaction

    from modelops.settings import get_settings
    from tasks.observe import TrafficProgress

    if (txn := get_transaction()) is not None:
        registry = Registry(get_settings().registry)
        txn.set("traffic_before", snapshot_traffic(registry, manifest.model_id))
        txn.set("traffic_counts", {v.version: len([i for i in registry.instances(manifest.model_id, v.version)
                                                   if i.state in LIVE_INSTANCE_STATES])
                                   for v in registry.versions(manifest.model_id)})
        txn.set("traffic_of", (manifest.model_id, manifest.version, image))
    result = rollout_task_fn(manifest, package, image, on_step=TrafficProgress(manifest.model_id, manifest.version))
    get_run_logger().info("traffic (%s: %s): %s", result["strategy"], result.get("reason", ""), result["weights"])
    return result


@rollout_task.on_rollback
def _undo_traffic(txn) -> None:
    """Transaction rollback: the model's traffic as it was before this rollout."""
    from modelops.settings import get_settings
    from tasks.observe import TrafficProgress

    settings = get_settings()
    model_id, version, image = txn.get("traffic_of")
    before, counts = txn.get("traffic_before"), txn.get("traffic_counts")
    registry, router, provider = backends.parts(settings)
    if before.get(version, ("", 0))[0] == "serving":
        version_to_fail = None  # it served before this run (a resumed rollout): restore it like the others
    else:
        version_to_fail = version
    restore_traffic(model_id, version_to_fail, before, registry, router, drain_and_stop=provider.stop,
                    reason="rolled back: a later stage of the rollout failed")
    TrafficProgress(model_id, version)(0)  # the UI's progress bar says it too
    # Capacity back: a red-black scaled the replaced versions down as their weights fell.
    for v, count in counts.items():
        if v != version and before[v][0] == "serving" and image is not None:
            provider.scale(model_id, v, count, sealed_package(settings, model_id, v), image,
                           unroute=lambda: commit_routes(registry, router))
