"""Traffic decisions: which weight each version of a model gets after a rollout.

First version of a model: weight 100. Later versions, by the manifest's ``strategy``
(``auto`` → red-black when the I/O schema hash equals the serving version's, else versioned):

- red-black: stepped, gated and rolled back by :mod:`tasks.traffic.rollout`; :func:`plan_weights`
  gives its end state (the new version 100, the previous ones 0).
- versioned: the new version is reachable by ``X-Model-Version`` only (weight 0) and the
  serving version keeps the model's default route.
"""

from __future__ import annotations

import logging

from modelops.errors import TrafficError
from modelops.manifest import Manifest
from modelops.registry import Registry
from modelops.settings import get_settings
from tasks import backends
from tasks.traffic.interface import Router, commit_routes

__all__ = ["choose_strategy", "plan_weights", "resolve_strategy", "schema_diff", "shift_traffic"]

log = logging.getLogger(__name__)


def schema_diff(old: Manifest, new: Manifest) -> list[str]:
    """Differences between two versions' I/O schemas (tensor names, datatypes, dims), one line
    each (``input text_input: BYTES [1] → FP32 [1]``); empty when they are the same."""
    lines = []
    for side, a, b in zip(("input", "output"), old.tensors(), new.tensors()):
        was = {t.name: (t.datatype, list(t.dims)) for t in a}
        now = {t.name: (t.datatype, list(t.dims)) for t in b}
        for name in sorted(set(was) | set(now)):
            if name not in now:
                lines.append(f"{side} {name}: removed (was {was[name][0]} {was[name][1]})")
            elif name not in was:
                lines.append(f"{side} {name}: added ({now[name][0]} {now[name][1]})")
            elif was[name] != now[name]:
                lines.append(f"{side} {name}: {was[name][0]} {was[name][1]} → {now[name][0]} {now[name][1]}")
    return lines


def choose_strategy(manifest: Manifest, registry: Registry) -> tuple[str, str]:
    """``(strategy, reason)`` for rolling out ``manifest``: ``first``, ``red-black`` or ``versioned``.

    ``auto`` picks red-black when the I/O schema equals every serving version's, else versioned.

    Raises:
        TrafficError: the manifest asks for red-black but the schema changed (the difference is
            in the message).
    """
    serving = [v for v in registry.versions(manifest.model_id) if v.state == "serving" and v.version != manifest.version]
    if not serving:
        return "first", "no version of the model is serving"
    diffs = {v.version: schema_diff(v.manifest, manifest) for v in serving}
    changed = {v: d for v, d in diffs.items() if d}
    shown = "; ".join(f"vs {v}: " + ", ".join(d) for v, d in changed.items())
    if manifest.strategy == "red-black" and changed:
        raise TrafficError(f"strategy red-black needs an unchanged I/O schema, but it changed ({shown}); "
                           "use strategy versioned (or auto)")
    if manifest.strategy != "auto":
        return manifest.strategy, f"the manifest asks for {manifest.strategy}" + (f" (schema changed: {shown})"
                                                                                   if changed else "")
    if changed:
        return "versioned", f"the I/O schema changed ({shown})"
    return "red-black", f"the I/O schema equals the serving version{'s' if len(serving) > 1 else ''} " \
                        f"({', '.join(v.version for v in serving)})"


def resolve_strategy(manifest: Manifest, registry: Registry) -> str:
    """``first``, ``red-black`` or ``versioned`` for rolling out ``manifest`` (see :func:`choose_strategy`)."""
    return choose_strategy(manifest, registry)[0]


def plan_weights(manifest: Manifest, registry: Registry, strategy: str) -> dict[str, int]:
    """New weights ``{version: 0..100}`` for every version of the model that changes."""
    others = [v for v in registry.versions(manifest.model_id) if v.state == "serving" and v.version != manifest.version]
    if strategy == "first":
        return {manifest.version: 100}
    if strategy == "red-black":
        return {manifest.version: 100, **{v.version: 0 for v in others}}
    if strategy == "versioned":
        return {manifest.version: 0}
    raise ValueError(f"unknown strategy {strategy!r}")


def shift_traffic(manifest: Manifest, registry: Registry | None = None, router: Router | None = None) -> dict:
    """Apply the rollout of ``manifest`` at the router and record it.

    The registry's weights are written first; if the router refuses them, they are restored
    and the previous routes re-applied, so what was serving keeps serving.

    Returns:
        ``{"strategy", "weights"}`` as applied.

    Raises:
        TrafficError: the router refused the new routes (after restoring the old ones).
    """
    settings = get_settings()
    registry = registry or Registry(settings.registry)
    router = router or backends.router(settings)
    strategy = resolve_strategy(manifest, registry)
    weights = plan_weights(manifest, registry, strategy)
    before = {v.version: (v.weight, v.state) for v in registry.versions(manifest.model_id)}
    registry.set_weights(manifest.model_id, weights)
    registry.set_strategy(manifest.model_id, manifest.version, strategy)
    registry.set_state(manifest.model_id, manifest.version, "serving")
    for version, weight in weights.items():
        if version != manifest.version and weight == 0:
            registry.set_state(manifest.model_id, version, "draining", f"replaced by {manifest.version} ({strategy})")
    try:
        commit_routes(registry, router)
    except TrafficError:
        registry.set_weights(manifest.model_id, {v: w for v, (w, _) in before.items()})
        for v, (_, state) in before.items():
            registry.set_state(manifest.model_id, v, state)  # type: ignore[arg-type]
        commit_routes(registry, router)
        raise
    log.info("traffic for %s: %s via %s", manifest.model_id, weights, strategy)
    return {"strategy": strategy, "weights": weights}
