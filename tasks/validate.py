"""validate: check an announcement and record it in the registry before anything else runs.

Also decides whether there is anything to do: a version that is already serving with a live,
ready instance is left alone (re-announcing is idempotent).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prefect import task

from modelops.errors import ManifestError, MaterializeError
from modelops.manifest import Manifest
from modelops.registry import Registry
from modelops.settings import get_settings
from tasks import backends
from tasks._retry import retry_unless_bad_input
from tasks.materialize import evict_version, list_source
from tasks.package import preflight

log = logging.getLogger(__name__)

__all__ = ["Announcement", "nothing_to_do", "record_failure_task", "rollout_finished", "validate", "validate_task"]


@dataclass(frozen=True)
class Announcement:
    """Outcome of validation: ``nothing_to_do`` says why nothing needs doing ("" if the rollout
    goes on); ``files`` is the number of files found at the source (0 when not listed)."""

    manifest: Manifest
    nothing_to_do: str
    files: int


def rollout_finished(registry: Registry, manifest: Manifest) -> bool:
    """The version's rollout finished, as the registry says: it serves and is the default (weight
    100), or a versioned deployment (promoted, if the manifest asks). A red-black interrupted
    mid-shift (a crashed flow run) is not finished: announcing again resumes it."""
    row = registry.get_version(manifest.model_id, manifest.version)
    if row is None or row.state != "serving" or (row.weight < 100 and row.strategy != "versioned"):
        return False
    return not (manifest.promote and row.weight < 100)  # else crashed between the traffic stage and promote


def _serving_and_ready(registry: Registry, manifest: Manifest) -> bool:
    """:func:`rollout_finished`, and one of the version's instances answers ready."""
    if not rollout_finished(registry, manifest):
        return False
    provider = backends.provider(registry=registry)
    return any(inst.state == "running" and provider.is_ready(inst)
               for inst in registry.instances(manifest.model_id, manifest.version))


def nothing_to_do(manifest: Manifest, registry: Registry | None = None) -> str:
    """Why announcing ``manifest`` changes nothing now, or ``""``: the version is already
    serving and ready, or it is draining (re-announcing must not silently move traffic back to a
    replaced version). Checked at validation and again once the model's rollout lock is held,
    since another run of the same version may have finished while this one waited."""
    registry = registry or Registry(get_settings().registry)
    if _serving_and_ready(registry, manifest):
        return f"{manifest.model_id} version {manifest.version} is already serving; nothing changed"
    row = registry.get_version(manifest.model_id, manifest.version)
    if row is not None and row.state == "draining":
        return (f"{manifest.model_id} version {manifest.version} is draining ({row.reason}); nothing changed: "
                "announce a new version to roll forward")
    return ""


def validate(manifest: Manifest, flow_run_id: str = "") -> Announcement:
    """Check the manifest against the platform and the source for weights, then record the
    announcement.

    Raises:
        ManifestError: a runtime request off the pin, a python-backend model that does not fit
            the frontend, a bad plugin wheel (:func:`tasks.package.preflight`); the source is
            missing or holds no weights; or the version was announced before with a different
            manifest. Nothing is recorded in that case.
    """
    registry = Registry(get_settings().registry)
    row = registry.get_version(manifest.model_id, manifest.version)
    if row is not None and row.manifest != manifest:
        raise ManifestError(
            f"version: {manifest.model_id} version {manifest.version} was already announced with a different "
            f"manifest (it is {row.state}); versions are immutable, announce a new version"
        )
    if done := nothing_to_do(manifest, registry):
        return Announcement(manifest, done, 0)
    preflight(manifest)  # runtime request, python-backend I/O and plugins, before anything is recorded
    files = list_source(manifest)
    registry.record_announcement(manifest, flow_run_id)
    return Announcement(manifest, "", len(files))


@task(name="validate", retries=2, retry_delay_seconds=3, retry_condition_fn=retry_unless_bad_input,
      timeout_seconds=120, tags=["modelops"])
def validate_task(manifest: Manifest) -> Announcement:
    """Prefect task around :func:`validate`."""
    from prefect import get_run_logger
    from prefect.runtime import flow_run

    result = validate(manifest, flow_run.get_id() or "")
    logger = get_run_logger()
    if result.nothing_to_do:
        logger.info(result.nothing_to_do)
    else:
        logger.info("%s version %s announced: %d files at %s", manifest.model_id, manifest.version, result.files,
                    manifest.source)
    return result


@task(name="record_failure", retries=2, retry_delay_seconds=1, timeout_seconds=30, tags=["modelops"])
def record_failure_task(manifest: Manifest, stage: str, error: str) -> None:
    """Mark the version failed in the registry with the stage and error that stopped it (no-op
    when validation refused it before anything was recorded)."""
    settings = get_settings()
    registry = Registry(settings.registry)
    if registry.get_version(manifest.model_id, manifest.version) is not None:
        registry.set_state(manifest.model_id, manifest.version, "failed", f"{stage}: {error}")
        if stage in _BEFORE_SERVING:
            _drop_copy(manifest, settings, registry)


# A version that failed at these stages never had an instance: nothing reads its FSx copy.
_BEFORE_SERVING = ("materialize", "image", "package")


def _drop_copy(manifest: Manifest, settings, registry: Registry) -> None:
    """Remove the FSx copy of a version that failed before serving (its files shared with other
    versions stay theirs): a version is immutable, so announcing it again fails the same way, or,
    after a passing cause, pulls what no other version holds."""
    try:
        gone = evict_version(manifest.model_id, manifest.version, settings, registry)
    except MaterializeError:
        return  # not cached (it failed before its pull finished)
    log.info("removed the FSx copy of failed %s %s (%.1f MB, files other versions share "
                                     "kept)", manifest.model_id, manifest.version, gone["bytes"] / 1e6)
