"""The Prefect task around :func:`~tasks.materialize.transfer.materialize`."""

from __future__ import annotations

from prefect import task

from modelops.manifest import Manifest
from modelops.settings import get_settings
from tasks._retry import retry_unless_bad_input
from tasks.materialize.cache import evict
from tasks.materialize.transfer import MaterializeResult, materialize

__all__ = ["materialize_task"]


# Transfers fail transiently (throttling, a dropped connection); a retry resumes from what
# was already verified. No Prefect timeout: the flow runs this in a worker thread, where Prefect's
# timeout cannot interrupt it (and warns so in the run's log); materialize_timeout_s bounds it.
@task(name="materialize", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_unless_bad_input,
      tags=["modelops"])
def materialize_task(manifest: Manifest) -> MaterializeResult:
    """Prefect task around :func:`materialize`, with a progress artifact and eviction."""
    from prefect import get_run_logger
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    settings = get_settings()
    state = {"todo": 0, "done": 0, "shown": -1, "artifact": None}

    def on_total(todo: int) -> None:
        state["todo"] = todo
        if todo:
            state["artifact"] = create_progress_artifact(
                0.0, key=f"materialize-{manifest.model_id}", description=f"weights of {manifest.model_id} {manifest.version}")

    def on_progress(n: int) -> None:
        state["done"] += n
        pct = int(100 * state["done"] / max(state["todo"], 1))
        if state["artifact"] and pct >= state["shown"] + 5:  # a few dozen updates, not one per chunk
            state["shown"] = pct
            update_progress_artifact(state["artifact"], float(pct))

    result = materialize(manifest, settings, progress=on_progress, total_callback=on_total)
    if state["artifact"]:
        update_progress_artifact(state["artifact"], 100.0)
    else:  # nothing to transfer: the UI still shows the stage as done
        create_progress_artifact(100.0, key=f"materialize-{manifest.model_id}",
                                 description=f"weights of {manifest.model_id} {manifest.version} (cache hit)")
    logger = get_run_logger()
    logger.info("weights of %s/%s on FSx at %s: %d files, %.1f MB; %.1f MB transferred in %.1f s (%.0f MB/s)%s",
                manifest.model_id, manifest.version, result.path, result.files, result.bytes / 1e6,
                result.transferred / 1e6, result.seconds, result.mb_per_s, " (cache hit)" if not result.transferred else "")
    if settings.cache_budget_gb is not None:
        for v in evict(int(settings.cache_budget_gb * 1e9), settings, keep=(manifest.model_id, manifest.version)):
            logger.info("%s %s/%s (%.1f MB, %s)", "reclaimed" if v["leftover"] else "evicted", v["model_id"],
                        v["version"], v["bytes"] / 1e6, "abandoned staging" if v["leftover"] else "least recently used")
    return result
