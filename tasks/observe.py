"""What people see of a rollout: stage events, and artifacts with stable keys.

Events (Prefect's event stream; chain automations and alerts on them):
``modelops.stage.<stage>.completed`` and ``modelops.stage.<stage>.failed``, resource
``modelops.model.<model_id>`` (labels ``modelops.version``, ``modelops.stage``), payload
``{"model_id", "version", "stage", "duration_s", "error"}``; emitted inside a flow run, the run
is a related resource (Prefect adds it).

Artifacts (keys use only ``[a-z0-9-]``, as Prefect requires; each new one with the same key
becomes that key's latest version in the UI):

- ``materialize-<model_id>``  progress of the weights' transfer (tasks/materialize/);
- ``traffic-<model_id>``      progress of the traffic shift: the new version's weight in percent;
- ``versions-<model_id>``     table of versions, states, weights and instances after each change;
- ``rollout-<model_id>``      the rollout report (markdown): outcome, stages and durations,
                              strategy and why, gate results, final weights. On failure its first
                              line names the cause.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from modelops.errors import ModelopsError
from modelops.registry import Registry
from modelops.settings import get_settings

__all__ = ["InjectedFailure", "Stages", "TrafficProgress", "emit_stage_event", "endpoints_text", "publish_markdown",
           "publish_rollout_report", "publish_versions_table", "rollout_report", "weights_text"]

log = logging.getLogger(__name__)

EVENT_PREFIX = "modelops.stage"


class InjectedFailure(ModelopsError):
    """A stage failed on purpose (setting ``fail_stage``, a failure drill)."""


def emit_stage_event(model_id: str, version: str, stage: str, outcome: str, duration_s: float,
                     error: str = "") -> None:
    """Emit ``modelops.stage.<stage>.<outcome>`` (outcome ``completed`` or ``failed``) for the model.

    Never raises: an unreachable event stream must not fail a rollout (it is logged).
    """
    try:
        from prefect.events import emit_event

        emit_event(
            event=f"{EVENT_PREFIX}.{stage}.{outcome}",
            resource={"prefect.resource.id": f"modelops.model.{model_id}", "prefect.resource.name": model_id,
                      "modelops.version": version, "modelops.stage": stage},
            payload={"model_id": model_id, "version": version, "stage": stage, "duration_s": round(duration_s, 3),
                     "error": error[:2000]},
        )
    except Exception as e:
        log.warning("could not emit %s.%s.%s: %s", EVENT_PREFIX, stage, outcome, e)


@dataclass
class Stages:
    """The stages one lifecycle run went through, in order, with their durations (s).

    ``with stages.run("package"):`` times the body, emits the stage's event and records it; an
    exception escaping the body marks the stage failed (and is re-raised). When the setting
    ``fail_stage`` names the stage, it fails at its start with :class:`InjectedFailure`.
    """

    model_id: str
    version: str
    rows: list[dict] = field(default_factory=list)

    @contextmanager
    def run(self, stage: str, *, started: float | None = None) -> Iterator[dict]:
        """Time the body as ``stage`` (from ``started``, a ``time.monotonic()`` value, if the
        work began earlier, e.g. a submitted task). Yields the row; the body may add ``detail``."""
        row = {"stage": stage, "outcome": "running", "duration_s": 0.0, "detail": ""}
        self.rows.append(row)
        t0 = time.monotonic() if started is None else started
        try:
            if get_settings().fail_stage == stage:
                raise InjectedFailure(f"injected failure at stage {stage} (setting MODELOPS_FAIL_STAGE={stage})")
            yield row
        except BaseException as e:
            row.update(outcome="failed", duration_s=round(time.monotonic() - t0, 2), detail=row["detail"] or str(e))
            emit_stage_event(self.model_id, self.version, stage, "failed", row["duration_s"], str(e))
            raise
        row.update(outcome="completed", duration_s=round(time.monotonic() - t0, 2))
        emit_stage_event(self.model_id, self.version, stage, "completed", row["duration_s"])

    @property
    def failed(self) -> dict | None:
        """The first failed stage's row, or None."""
        return next((r for r in self.rows if r["outcome"] == "failed"), None)

    def table(self) -> str:
        """The stages as a markdown table."""
        lines = ["| stage | outcome | seconds | detail |", "|---|---|---|---|"]
        for r in self.rows:
            detail = " ".join(str(r["detail"]).split()).replace("|", "\\|")[:300]
            lines.append(f"| {r['stage']} | {r['outcome']} | {r['duration_s']} | {detail} |")
        return "\n".join(lines)


def _versions(model_id: str) -> list[dict]:
    registry = Registry(get_settings().registry)
    rows = []
    for v in registry.versions(model_id):
        instances = registry.instances(model_id, v.version)
        rows.append({"version": v.version, "state": v.state, "weight": v.weight, "strategy": v.strategy,
                     "instances": ", ".join(i.name for i in instances) or "-", "reason": v.reason[:200]})
    return rows


def publish_versions_table(model_id: str, change: str) -> list[dict]:
    """Publish the table artifact ``versions-<model_id>`` (version, state, weight in percent,
    strategy, live instances, reason) after ``change``; return its rows. Best effort."""
    try:
        from prefect.artifacts import create_table_artifact

        rows = _versions(model_id)
        create_table_artifact(rows, key=f"versions-{model_id}", description=f"{model_id} after {change}")
    except Exception as e:  # best effort: a report must never fail the rollout
        log.warning("could not publish versions-%s: %s", model_id, e)
        return []
    return rows


class TrafficProgress:
    """``TrafficProgress(model_id, version)(pct)`` publishes the progress artifact
    ``traffic-<model_id>``: the new version's share of the model's traffic (0..100)."""

    def __init__(self, model_id: str, version: str) -> None:
        self.model_id, self.version, self.artifact = model_id, version, None

    def __call__(self, pct: float) -> None:
        try:
            from prefect.artifacts import (
                create_progress_artifact,
                update_progress_artifact,
            )

            if self.artifact is None:
                self.artifact = create_progress_artifact(
                    float(pct), key=f"traffic-{self.model_id}",
                    description=f"traffic to {self.model_id} {self.version} (percent)")
            else:
                update_progress_artifact(self.artifact, float(pct))
        except Exception as e:
            log.warning("could not publish traffic-%s: %s", self.model_id, e)


def _gates_table(rollout: dict) -> str:
    rows = ["| step (new %) | gate | requests new | errors new | p99 new / old (s) | TTFT p90 new / old (s) | "
            "inter-token p90 new / old (s) |", "|---|---|---|---|---|---|---|"]
    for st in rollout.get("steps", []):
        g = st.get("gate") or {}
        judged = g.get("judged", "traffic")  # what the verdict rests on (tasks/traffic/gates.py)
        if not g.get("passed"):
            verdict = g.get("reason") or "not reached"
        elif judged != "traffic":
            verdict = f"pass ({judged})"
        else:
            verdict = "pass" if g.get("requests_new") else "pass (no traffic)"
        pairs = [" / ".join("-" if g.get(f"{k}_{side}_s") is None else str(g[f"{k}_{side}_s"]) for side in ("new", "old"))
                 for k in ("p99", "ttft_p90", "itl_p90")]
        step = "shadow" if st.get("phase") == "shadow" else st["weight"]
        rows.append(f"| {step} | {verdict} | {g.get('requests_new', '-')} | {g.get('errors_new', '-')} | "
                    + " | ".join(pairs) + " |")
    if rollout.get("rollback_s") is not None:
        rows.append(f"\nweights restored in {rollout['rollback_s']} s")
    return "\n".join(rows)


def weights_text(weights: dict[str, int]) -> str:
    """``{"3": 0, "4": 100}`` as people read it: ``3: 0%, 4: 100%`` (by version)."""
    return ", ".join(f"{v}: {w}%" for v, w in sorted(weights.items())) or "none"


def endpoints_text(endpoints: dict[str, str]) -> str:
    """An instance's endpoints for a markdown report: each address in a code span, so a
    renderer links nothing it would cut short (a bare URL before a quote became a broken link)."""
    return ", ".join(f"{name} `{address}`" for name, address in endpoints.items())


def rollout_report(model_id: str, version: str, stages: Stages, *, outcome: str, cause: str = "",
                   strategy: str = "", why: str = "", rollout: dict | None = None, notes: list[str] = ()) -> str:
    """The rollout report as markdown: a first line with the outcome (and the cause on failure),
    then stages and durations, the strategy and why, gate results and the final weights."""
    head = f"**{outcome}**" + (f": {' '.join(cause.split())}" if cause else "")
    parts = [head, f"# {model_id} version {version}", "## Stages", stages.table()]
    if strategy:
        parts += ["## Strategy", f"{strategy}: {why}"]
    if rollout and rollout.get("steps"):
        parts += ["## Gates", _gates_table(rollout)]
    try:
        weights = ", ".join(f"{r['version']}: {r['weight']}% ({r['state']})" for r in _versions(model_id)
                            if r["state"] in ("serving", "draining")) or "none"
    except Exception as e:  # the report must still say what failed
        weights = f"unknown (the registry could not be read: {e})"
    parts += ["## Final weights", weights]
    if notes:
        parts += ["## Details", "\n".join(f"- {n}" for n in notes)]
    return "\n\n".join(parts)


def publish_rollout_report(model_id: str, version: str, markdown: str) -> None:
    """Publish the markdown artifact ``rollout-<model_id>``. Best effort."""
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(markdown, key=f"rollout-{model_id}",
                                 description=f"rollout of {model_id} {version}")
    except Exception as e:
        log.warning("could not publish rollout-%s: %s", model_id, e)


def publish_markdown(key: str, markdown: str, description: str) -> str | None:
    """Publish the markdown artifact ``key``, linked to the flow or task run this runs in, if any
    (a CLI command runs in none: then through the API's own artifact call, which Prefect's helper
    now warns about outside a run); ``key``, or None when Prefect could not take it (best effort:
    a report never fails what it reports)."""
    try:
        from prefect.context import get_run_context
        from prefect.exceptions import MissingContextError

        try:
            get_run_context()
        except MissingContextError:
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.actions import ArtifactCreate

            with get_client(sync_client=True) as client:
                client.create_artifact(ArtifactCreate(key=key, type="markdown", data=markdown, description=description))
        else:
            from prefect.artifacts import create_markdown_artifact

            create_markdown_artifact(markdown, key=key, description=description)
    except Exception as e:  # noqa: BLE001
        log.warning("could not publish %s: %s", key, e)
        return None
    return key
