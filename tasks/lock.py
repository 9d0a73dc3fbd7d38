"""One rollout per model at a time; different models roll out in parallel.

Two layers: a Prefect global concurrency limit ``rollout-<model_id>`` (limit 1, created on first
use; visible and adjustable in the Prefect UI) when a Prefect API is configured, and a row in
the registry (:meth:`modelops.registry.Registry.try_lock_rollout`) that holds in every mode,
including ``--local`` runs. The row is renewed every ``LEASE_S / 4`` seconds while held, so a
holder in another pod that died is recognised after ``LEASE_S`` (on its own host, by its pid at
once). A second announcement of the same model waits for the first rollout (up to
``rollout_lock_wait_s``), then goes on, or fails naming who holds the lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import ExitStack, contextmanager

from modelops.errors import TrafficError
from modelops.registry import Registry
from modelops.settings import get_settings

__all__ = ["rollout_lock"]

log = logging.getLogger(__name__)

LEASE_S = 60.0  # a registry lock not renewed for this long, held from another host, is taken over


def _prefect_limit(stack: ExitStack, name: str, wait_s: float) -> None:
    """Occupy the Prefect global concurrency limit ``name`` (created with limit 1 if missing)."""
    if not os.environ.get("PREFECT_API_URL"):
        return  # in-process runs without a server: the registry lock alone
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            except ObjectAlreadyExists:
                pass
    # A short lease, renewed while held: a crashed holder (worker killed) frees the slot within
    # about a lease (60 s, the least the server accepts) plus its repossessor loop (15 s), not 300 s.
    stack.enter_context(concurrency(name, occupy=1, timeout_seconds=wait_s, strict=True, lease_duration=60,
                                    # A renewal hiccup (API restart) must not cancel a rollout
                                    # mid-step; the registry row still guards the model.
                                    raise_on_lease_renewal_failure=False))


@contextmanager
def rollout_lock(model_id: str, holder: str, wait_s: float | None = None, on_wait=None, experiment_ok: bool = False):
    """Hold the model's rollout lock for the body.

    Args:
        holder: who holds it (the flow run); wait_s: seconds to wait for another rollout of the
            model (default ``rollout_lock_wait_s``); on_wait: ``callable(message)`` told once when
            this call has to wait; experiment_ok: the holder starts or stops an experiment (every
            other holder is refused while one runs on the model).

    Raises:
        TrafficError: the lock was still held by another rollout after ``wait_s``, or an
            experiment runs on the model (nothing changed: the lock is released at once).
    """
    settings = get_settings()
    wait_s = settings.rollout_lock_wait_s if wait_s is None else wait_s
    registry = Registry(settings.registry)
    deadline = time.monotonic() + wait_s
    told = False
    while held_by := registry.try_lock_rollout(model_id, holder, os.getpid(), lease_s=LEASE_S):
        if time.monotonic() > deadline:
            raise TrafficError(f"another rollout of {model_id} is in progress: {held_by}; waited {wait_s:.0f} s. "
                               "Announce again when it has finished (`modelops status`)")
        if not told and on_wait is not None:
            on_wait(f"waiting for the rollout of {model_id} held by {held_by}")
            told = True
        time.sleep(1)
    if not experiment_ok and (running := registry.experiment(model_id)):
        registry.unlock_rollout(model_id, holder)
        arms = ", ".join(f"{a.version}:{a.percent}" for a in running.spec().arms)
        raise TrafficError(f"an experiment runs on {model_id} (arms {arms}); its traffic is not moved by a rollout, "
                           f"promote or rollback meanwhile: `modelops experiment stop {model_id} --keep VERSION` "
                           "ends it, then try again")
    stop = threading.Event()
    heartbeat = threading.Thread(target=_renew, args=(registry, model_id, holder, stop, _run_logger()), daemon=True,
                                 name=f"rollout-lock-{model_id}")
    heartbeat.start()
    try:
        with ExitStack() as stack:
            _prefect_limit(stack, f"rollout-{model_id}", max(1.0, deadline - time.monotonic()))
            yield
    finally:
        stop.set()
        heartbeat.join(timeout=10)
        registry.unlock_rollout(model_id, holder)


def _run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The flow or task run's logger (its records reach the run's logs in the UI, also from the
    heartbeat thread, which has no run context of its own), or this module's outside a run."""
    try:
        from prefect.logging import get_run_logger

        return get_run_logger()
    except Exception:
        return log


def _renew(registry: Registry, model_id: str, holder: str, stop: threading.Event,
           logger: logging.Logger | logging.LoggerAdapter = log) -> None:
    """Renew the registry lock until ``stop``; a failed renewal is logged and tried again (a
    registry hiccup must not end a rollout; the Prefect slot still guards the model)."""
    while not stop.wait(LEASE_S / 4):
        try:
            if not registry.renew_rollout_lock(model_id, holder):
                logger.error("the rollout lock of %s is no longer held by %s: it missed its %.0f s lease and "
                             "another rollout took it over", model_id, holder, LEASE_S)
                return
        except Exception as e:
            logger.warning("could not renew the rollout lock of %s: %s", model_id, e)
