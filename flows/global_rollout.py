"""global-rollout: one announcement, every region, wave by wave.

Started by the ``global-rollout`` deployment's trigger on ``modelops.model.announced.global``
(what ``modelops announce`` emits once a regions file exists; modelops/regions.py):

regions checked (pools, deployments) → weights pre-materialized in every region at once →
for each wave: the regional lifecycle in each of its regions (``model-lifecycle/<region>`` on
the region's pool, in parallel) → bake (``bake-version/<region>``) → next wave.

A failing region rolls itself back (its lifecycle's transaction); the wave stops there, and the
plan's ``on_failure`` decides whether earlier waves keep the new version or roll back. A region
already serving the version is skipped, so announcing again resumes a partial global rollout.
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed, Failed

from modelops.manifest import Manifest
from tasks.observe import publish_markdown
from tasks.regions import check_region_deployments, default_versions, finished_regions, load_plan, region_run_task

__all__ = ["global_rollout"]


@flow(name="global-rollout", log_prints=True, flow_run_name="{manifest.model_id}-{manifest.version}-global")
def global_rollout(manifest: Manifest, announcement_id: str = ""):
    """Roll ``manifest`` out to every region of the regions file, wave by wave.

    Args:
        manifest: the announcement; announcement_id: the event's id (``modelops announce --wait``
            finds this run by it).

    Returns:
        Completed with each wave's regions and seconds, or Failed naming the wave, the region
        and its cause (the ``global-<model_id>`` artifact has the table either way).
    """
    logger = get_run_logger()
    model_id, version = manifest.model_id, manifest.version
    began = time.monotonic()
    rows: list[dict] = []
    run_key = str(flow_run.get_id() or announcement_id)

    def end(state, message: str):
        _publish(model_id, version, rows, message)
        return state(message=message)

    try:
        plan = load_plan()
        check_region_deployments(plan)
    except Exception as e:  # noqa: BLE001 - a bad regions file or a missing pool: no region changed
        return end(Failed, f"{model_id} {version}: regions refused before any region changed: {e}")
    payload = manifest.model_dump(mode="json")

    # Pre-materialization: every region's FSx at once, before the first wave changes anything.
    pulls = [region_run_task.submit(plan, r.name, "materialize-weights", {"manifest": payload},
                                    f"{run_key}:materialize:{r.name}") for r in plan.regions]
    pulled = [f.result() for f in pulls]
    rows += [{"wave": "pre", **p.as_dict()} for p in pulled]
    if bad := [p for p in pulled if not p.ok]:
        return end(Failed, f"{model_id} {version}: pre-materialization failed, no region changed: " +
                   "; ".join(f"{p.region}: {p.message}" for p in bad))

    before = default_versions(plan, model_id)
    finished = finished_regions(plan, manifest)
    done: list[str] = []  # regions this run rolled out
    timings = []
    waves = plan.wave_plan()
    for n, wave in enumerate(waves, 1):
        wave_began = time.monotonic()
        todo = [r for r in wave if r.name not in finished]
        later = any(r.name not in finished for w in waves[n:] for r in w)
        for r in wave:
            if r not in todo:
                rows.append({"wave": n, "region": r.name, "flow": "model-lifecycle", "state": "SKIPPED",
                             "message": f"already serving {version}", "seconds": 0.0})
                logger.info("wave %d: %s serves %s already: skipped", n, r.name, version)
        runs = [region_run_task.submit(plan, r.name, "model-lifecycle",
                                       {"manifest": payload, "announcement_id": announcement_id},
                                       f"{run_key}:lifecycle:{r.name}") for r in todo]
        results = [f.result() for f in runs]
        rows += [{"wave": n, **x.as_dict()} for x in results]
        if failed := [x for x in results if not x.ok]:
            done += [x.region for x in results if x.ok]
            undo = _after_failure(plan, model_id, before, done, run_key, rows)
            return end(Failed, f"{model_id} {version}: wave {n} failed in " +
                       "; ".join(f"{x.region} ({x.state.lower()}: {x.message})" for x in failed) +
                       f"; later waves not started; {undo}")
        done += [r.name for r in todo]
        if plan.bake_s and (todo or later):
            # The whole wave is watched, regions done before included: the next wave goes on their
            # health now (an earlier run may have ended before or during their bake).
            bakes = [region_run_task.submit(plan, r.name, "bake-version",
                                            {"model_id": model_id, "version": version, "seconds": plan.bake_s},
                                            f"{run_key}:bake:{r.name}") for r in wave]
            baked = [f.result() for f in bakes]
            rows += [{"wave": n, **b.as_dict()} for b in baked]
            if soured := [b for b in baked if not b.ok]:
                # The regions this run changed that failed their bake go back whatever the policy; one
                # that served the version before this run is left as it was, said.
                changed = [b.region for b in soured if b.region in done]
                said = [_roll_back(plan, model_id, before, changed, run_key, rows)] if changed else []
                said += [f"{b.region} served {version} before this run: left as it is (`modelops rollback "
                         f"{model_id}` there rolls it back)" for b in soured if b.region not in done]
                back = "; ".join(said)
                others = [r for r in done if r not in {b.region for b in soured}]
                undo = f"{back}; {_after_failure(plan, model_id, before, others, run_key, rows)}"
                return end(Failed, f"{model_id} {version}: wave {n}'s bake failed in " +
                           "; ".join(f"{b.region}: {b.message}" for b in soured) + f"; later waves not started; {undo}")
        skipped = f", skipped {', '.join(r.name for r in wave if r not in todo)}: done before" \
            if len(todo) < len(wave) else ""
        timings.append(f"wave {n} ({', '.join(r.name for r in wave)}) {time.monotonic() - wave_began:.0f} s{skipped}")
        logger.info("wave %d done: %s", n, timings[-1])
    return end(Completed, f"{model_id} {version} serves in every region: {'; '.join(timings)}; "
                          f"total {time.monotonic() - began:.0f} s")


def _after_failure(plan, model_id: str, before: dict[str, str | None], done: list[str], run_key: str,
                   rows: list[dict]) -> str:
    """``on_failure`` for the regions this run changed and that did not fail: keep the new
    version (said), or roll them back (:func:`_roll_back`)."""
    if not done:
        return "no other region was changed"
    if plan.on_failure == "keep":
        return f"{', '.join(done)} keep the new version (on_failure: keep)"
    return _roll_back(plan, model_id, before, done, run_key, rows)


def _roll_back(plan, model_id: str, before: dict[str, str | None], regions: list[str], run_key: str,
               rows: list[dict]) -> str:
    """Run ``rollback/<region>`` in each of ``regions``, back to the version it served by default
    before this run (a region that served none keeps the new one, said); what happened, one
    clause per region."""
    said = []
    for region in regions:
        previous = before[region]
        if previous is None:
            said.append(f"{region} keeps it (it served no earlier version)")
            continue
        back = region_run_task(plan, region, "rollback", {"model_id": model_id, "to_version": previous},
                               f"{run_key}:rollback:{region}")
        rows.append({"wave": "undo", **back.as_dict()})
        said.append(f"{region} rolled back to {previous}" if back.ok else
                    f"{region} NOT rolled back ({back.message}): run `modelops rollback {model_id}` there")
    return "; ".join(said)


def _publish(model_id: str, version: str, rows: list[dict], outcome: str) -> None:
    """The ``global-<model_id>`` markdown artifact: the outcome, then one row per regional run."""
    lines = [f"# Global rollout of {model_id} {version}", "", outcome, "",
             "| wave | region | flow | state | seconds | flow run | message |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        message = str(r.get("message", "")).replace("|", "\\|").replace("\n", " ")[:300]
        lines.append(f"| {r['wave']} | {r['region']} | {r['flow']} | {r['state']} | {r['seconds']} | "
                     f"{r.get('run_name', '')} | {message} |")
    publish_markdown(f"global-{model_id}", "\n".join(lines), f"global rollout of {model_id} {version}")
