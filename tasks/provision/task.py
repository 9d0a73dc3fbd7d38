"""The provision stage as a Prefect task, on whichever provider the settings choose
(:func:`tasks.backends.provider`): local processes or Kubernetes Deployments."""

from __future__ import annotations

import logging
import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from modelops.artifacts import Package
from modelops.errors import ModelLoadError, ProvisionError
from tasks import backends
from tasks.provision.interface import Endpoints

__all__ = ["provision_task", "stop_unserved_instances"]

log = logging.getLogger(__name__)


# No Prefect retries: inside the lifecycle's transaction a failed attempt rolls the whole
# transaction back (Prefect 3.9 Transaction.reset). The one transient failure worth a second
# try, a port taken between choosing and binding it, is retried in the body; a model that fails
# to load (ModelLoadError) fails the same way again. NO_CACHE: never skipped as "done before".
@task(name="provision", retries=0, timeout_seconds=1800, tags=["modelops"], cache_policy=NO_CACHE)
def provision_task(package: Package, image) -> tuple[str, Endpoints]:
    """Prefect task: a ready instance of ``package`` on the settings' provider (``image``: the
    built runtime locally, the planned image on Kubernetes). Inside a
    transaction, its ``on_rollback`` hook stops the instances this run started if a later
    stage fails (never an instance it reused, never while the version has router weight)."""
    from prefect import get_run_logger
    from prefect.transactions import get_transaction

    logger = get_run_logger()
    provider = backends.provider()
    existing = {i.name for i in provider.registry.instances(package.model_id, package.version)}
    t0 = time.monotonic()
    try:
        name, endpoints = provider.ensure_instance(package, image)
    except ModelLoadError:  # the model failed to load or its engine died: it would again
        raise
    except ProvisionError as e:  # judged transient: a port race, an engine killed from outside
        logger.warning("provision failed once (judged transient), trying again in 5 s: %s", e)
        time.sleep(5)
        name, endpoints = provider.ensure_instance(package, image)
    if (txn := get_transaction()) is not None:
        txn.set("provisioned", (package.model_id, package.version, name not in existing))
    logger.info("instance %s %s in %.0f s: %s", name, "reused" if name in existing else "ready",
                time.monotonic() - t0, endpoints.as_dict())
    return name, endpoints


@provision_task.on_rollback
def _undo_provision(txn) -> None:
    """Transaction rollback: drain and stop the version's instances if this run started them."""
    model_id, version, started = txn.get("provisioned")
    provider = backends.provider()
    row = provider.registry.get_version(model_id, version)
    if not started or row is None:
        return
    if row.weight > 0:
        log.error("not stopping %s %s: it still has weight %d (the traffic rollback did not finish)", model_id,
                  version, row.weight)
        return
    provider.stop_each(inst.name for inst in provider.registry.instances(model_id, version))


def stop_unserved_instances(model_id: str, version: str, why: str) -> list[str]:
    """Stop the instances of a version whose run ended before it served (a flow run cancelled
    mid-provision or mid-health check: no transaction rollback ran), and mark the version
    failed with ``why`` so announcing it again starts over. A version that is not provisioning
    (serving, draining...) or that has router weight is left alone: the run got far enough that
    ``modelops rollback`` decides. Returns the instance names stopped.

    Raises:
        ProvisionError: an instance could not be stopped (the others were).
    """
    provider = backends.provider()
    row = provider.registry.get_version(model_id, version)
    if row is None or row.state != "provisioning":
        return []
    if row.weight > 0:
        log.error("not stopping %s %s after %s: it has router weight %d; run `modelops rollback %s`", model_id,
                  version, why, row.weight, model_id)
        return []
    names = [inst.name for inst in provider.registry.instances(model_id, version)]
    log.warning("%s %s: %s; stopping its instances %s", model_id, version, why, names or "(none)")
    try:
        return provider.stop_each(names)
    finally:
        provider.registry.set_state(model_id, version, "failed", f"{why}; announce it again")
