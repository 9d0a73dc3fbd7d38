"""Shadow traffic on a model (:mod:`modelops.shadow`): start, compare, stop.

Start and stop change routes under the model's rollout lock. The comparison is read from the
instances that answered the model's clients (every running instance of its other versions): their
frontends sent the copies and counted what they found.
"""

from __future__ import annotations

import os

import httpx

from modelops.registry import Registry, Shadow
from modelops.shadow import ShadowStats, shadow_stats
from tasks.traffic.interface import Router, commit_routes
from tasks.traffic.shift import schema_diff

__all__ = ["check_shadow", "compare_shadow", "judge_shadow", "publish_shadow_report", "shadow_markdown", "start_shadow",
           "stop_shadow"]


def check_shadow(registry: Registry, model_id: str, version: str, percent: int) -> None:
    """Refuse a shadow that cannot run, before anything changes.

    Raises:
        ValueError: ``percent`` outside 1..100, an unknown model, a version that is not serving
            with weight 0 (it would copy its own requests to itself), a version whose I/O schema
            differs from the default version's (its requests cannot be replayed on it), or a
            shadow runs on the model already.
    """
    if not 1 <= percent <= 100:
        raise ValueError(f"--percent: {percent} is outside 1..100 (the share of the model's unpinned requests "
                         "copied to the shadow)")
    versions = {v.version: v for v in _known(registry, model_id)}
    row = versions.get(version)
    serving = ", ".join(sorted(v for v, r in versions.items() if r.state == "serving")) or "none"
    if row is None:
        raise ValueError(f"version {version!r} of {model_id} was never announced (serving: {serving}); announce it "
                         "with `strategy: versioned`, so it takes no traffic until promoted")
    if row.state != "serving":
        raise ValueError(f"version {version} of {model_id} is {row.state}{f' ({row.reason})' if row.reason else ''}: "
                         f"a shadow needs a serving version (serving: {serving})")
    if row.weight > 0:
        raise ValueError(f"version {version} of {model_id} takes {row.weight} % of its traffic already: a shadow is a "
                         "version that serves none; name one announced with `strategy: versioned` (weight 0)")
    if experiment := registry.experiment(model_id):
        arms = ", ".join(f"{a.version}:{a.percent}" for a in experiment.spec().arms)
        raise ValueError(f"an experiment runs on {model_id} (arms {arms}): its arms serve clients whatever their "
                         f"weights; `modelops experiment stop {model_id} --keep VERSION` first")
    default = registry.default_version(model_id)
    if default is None:
        raise ValueError(f"{model_id} has no single default version to copy requests from (a red-black shift is in "
                         "progress?); try again once it has finished")
    if diff := schema_diff(versions[default].manifest, row.manifest):
        raise ValueError(f"version {version} has another I/O schema than the default {default} ({'; '.join(diff)}): "
                         "its requests cannot be replayed on it; compare the two with an experiment instead "
                         f"(`modelops experiment start {model_id} --arms {default}:50,{version}:50 --key user`)")
    if running := registry.shadow(model_id):
        raise ValueError(_running_text(running))


def _known(registry: Registry, model_id: str) -> list:
    """The model's versions. Raises ValueError naming an unknown model."""
    versions = registry.versions(model_id)
    if not versions:
        raise ValueError(f"unknown model {model_id!r} (`modelops status` lists the models)")
    return versions


def _running_text(running: Shadow) -> str:
    if running.origin == "red-black":
        return (f"a shadow of {running.model_id} runs already: the shadow step of the red-black rollout of version "
                f"{running.version}; it ends with that step (`modelops status`)")
    return (f"a shadow of {running.model_id} runs already (version {running.version}, {running.percent} %); "
            f"`modelops shadow stop {running.model_id}` ends it")


def start_shadow(registry: Registry, router: Router, model_id: str, version: str, percent: int,
                 origin: str = "cli", lock: bool = True) -> Shadow:
    """Copy ``percent`` % of ``model_id``'s unpinned requests to ``version`` (checked by
    :func:`check_shadow`), under the rollout lock unless the caller holds it (``lock=False``).

    Raises:
        ValueError: what :func:`check_shadow` refuses.
        TrafficError: a rollout holds the model, or the router refused the routes (then nothing
            was kept).
    """
    from contextlib import nullcontext

    from tasks.lock import rollout_lock

    check_shadow(registry, model_id, version, percent)
    held = rollout_lock(model_id, holder=f"modelops shadow start (pid {os.getpid()})", wait_s=60,
                        experiment_ok=True) if lock else nullcontext()
    with held:
        row = registry.start_shadow(model_id, version, percent, origin)
        try:
            commit_routes(registry, router)
        except Exception:
            registry.stop_shadow(model_id)
            raise
    return row


def stop_shadow(registry: Registry, router: Router, model_id: str, lock: bool = True) -> Shadow:
    """End the model's shadow: no more copies (those in flight finish).

    Raises:
        ValueError: an unknown model, or the shadow is a red-black rollout's step (it ends with it).
        KeyError: no shadow runs on the model.
        TrafficError: a rollout holds the model, or the router refused the routes.
    """
    from contextlib import nullcontext

    from tasks.lock import rollout_lock

    _known(registry, model_id)
    running = registry.shadow(model_id)
    if running is None:
        raise KeyError(f"no shadow runs on {model_id} (`modelops shadow status` lists the running ones)")
    if lock and running.origin == "red-black":  # the rollout holds the lock and ends it itself
        raise ValueError(_running_text(running))
    held = rollout_lock(model_id, holder=f"modelops shadow stop (pid {os.getpid()})", wait_s=60,
                        experiment_ok=True) if lock else nullcontext()
    with held:
        row = registry.stop_shadow(model_id)
        commit_routes(registry, router)
    return row


def compare_shadow(registry: Registry, shadow: Shadow) -> ShadowStats:
    """The shadow's comparison so far, summed over the running instances of its model's other
    versions (an instance that does not answer its ``/metrics`` counts nothing)."""
    texts = []
    with httpx.Client(timeout=5) as client:
        for inst in registry.instances(shadow.model_id):
            if inst.model_version.version == shadow.version or inst.state != "running":
                continue
            if url := inst.endpoints.get("metrics"):
                try:
                    texts.append(client.get(url).text)
                except httpx.HTTPError:
                    continue
    return shadow_stats(texts, shadow.id)


def judge_shadow(stats: ShadowStats, *, max_failure_ratio: float, min_equal: float | None,
                 min_cosine: float | None) -> str | None:
    """Why a shadow's comparison fails a gate, or None when it passes: the shadow failed more
    than ``max_failure_ratio`` of its copies, greedy answers were equal less often than
    ``min_equal``, or an embedding's cosine fell below ``min_cosine`` (None: not judged). A
    comparison with no copy answered fails (nothing to judge is never a pass)."""
    sent = stats.compared + stats.shadow_failed
    if not sent:
        return f"no copy reached the shadow ({stats.dropped} dropped): nothing to judge"
    if stats.failure_rate > max_failure_ratio:
        return f"the shadow failed {stats.shadow_failed} of {sent} copies (over {max_failure_ratio:.0%})"
    if min_equal is not None and stats.equal_rate is not None and stats.equal_rate < min_equal:
        return f"greedy answers equal in {stats.equal} of {stats.greedy} ({stats.equal_rate:.1%} < {min_equal:.1%})"
    if min_cosine is not None and stats.cosine_min is not None and stats.cosine_min < min_cosine:
        return f"an embedding's cosine to the served one was {stats.cosine_min:.6f} (< {min_cosine})"
    return None


def shadow_markdown(shadow: Shadow, stats: ShadowStats, verdict: str = "") -> str:
    """The comparison as a Markdown report: what ran, the counts and rates, the first differing
    token's distribution and each side's latency."""
    d = stats.as_dict()

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f} ms"

    rows = [("copies compared", d["compared"]), ("failed by the shadow", d["shadow_failed"]),
            ("dropped (too many in flight)", d["dropped"]),
            ("greedy answers equal", f"{d['equal']} of {d['greedy']}" +
             (f" ({d['equal_rate']:.1%})" if d["equal_rate"] is not None else "")),
            ("embeddings compared (lowest cosine)", f"{d['cosines']}" +
             (f" ({d['cosine_min']:.6f})" if d["cosine_min"] is not None else "")),
            *((f"latency {q} served → shadow", f"{ms(d['latency_s']['primary'][q])} → {ms(d['latency_s']['shadow'][q])}")
              for q in ("p50", "p90"))]
    out = [f"# Shadow of {shadow.model_id}: version {shadow.version}, {shadow.percent} % of requests",
           f"Started {shadow.started_at:%Y-%m-%d %H:%M:%S} UTC by {shadow.origin}" +
           (f", stopped {shadow.stopped_at:%H:%M:%S}" if shadow.stopped_at else "") + ".", ""]
    if verdict:
        out += [f"**{verdict}**", ""]
    out += ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    if stats.first_diff:
        prev, parts = 0.0, []
        for le in sorted(stats.first_diff):
            n = stats.first_diff[le] - prev
            prev = stats.first_diff[le]
            if n:
                parts.append(f"≤ {le:g}: {n:.0f}" if le != float("inf") else f"> 256: {n:.0f}")
        out += ["", "First differing token of the greedy answers that differ (index in the shadow's answer): " +
                ", ".join(parts)]
    return "\n".join(out) + "\n"


def publish_shadow_report(shadow: Shadow, stats: ShadowStats, verdict: str = "") -> str | None:
    """Publish :func:`shadow_markdown` as the Prefect artifact ``shadow-<model_id>``; its key, or
    None when Prefect could not take it (best effort: a report never fails what it reports)."""
    from tasks.observe import publish_markdown

    return publish_markdown(f"shadow-{shadow.model_id}", shadow_markdown(shadow, stats, verdict),
                            f"shadow of {shadow.model_id} on version {shadow.version}")
