"""The local autoscaler: a control loop beside the stack that changes instance counts on load.

Every ``autoscale_interval_s`` it reads each serving version's instances
(:func:`~tasks.autoscale.signals.read_instance`) and feeds the version's
:class:`~modelops.scaling.Recommender` the HPA rule's recommendation on the manifest's signal
(:mod:`modelops.scaling`). When a decision changes the count it acts, in a thread of its own per
model so one model's minute-long cold start does not hold up another's decision:

- it takes the model's rollout lock (the registry row a rollout takes: a rollout waits for a
  scale action, and a model whose rollout holds the lock is left alone until it ends; the
  rollout then scales the versions it moves itself, in proportion to their weights);
- up: the provider starts instances (each ready before it counts), then the router takes them
  in; each server's weight is its version's weight split over its instances, so a version at
  30 % keeps 30 % whatever its count (:func:`~tasks.traffic.interface.routes_from_registry`);
- down: the newest instances leave the router first (state ``draining``), then drain (in-flight
  requests and streams finish) and stop (:meth:`~tasks.provision.interface.Provider.scale`).

Each decision is recorded in the registry (``modelops status`` shows the latest) and emitted as a
Prefect event ``modelops.scale.up`` / ``.down`` / ``.failed`` on resource ``modelops.model.<id>``.
Missing data (an instance whose ``/metrics`` does not answer) decides nothing and starts the
windows again; an instance that fails to start is reported and the version waits
``autoscale_backoff_s`` (doubled per further failure, at most 10 minutes) before trying again,
serving on what it has. Versions whose policy is not autoscaled (``min == max``) are only
brought up to ``min`` when they have fewer; they are never scaled down.

Scale from zero (``min: 0``): a version goes to zero once no request ran, waited or finished on
any of its instances for a whole ``scale_down_window_s``; the router then sends its requests to
the activator (:mod:`tasks.autoscale.activator`), which runs in this process: the first held
request wakes the loop, which starts one instance at once (no window: someone is waiting), and
the held requests go to it when it is up.

Each tick also reads the usage per API key and applies the tpm limits
(:mod:`tasks.autoscale.usage`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import httpx

from modelops.artifacts import sealed_package
from modelops.registry import LIVE_INSTANCE_STATES, Registry
from modelops.scaling import Recommender, Scaling, desired_instances
from modelops.settings import Settings, get_settings
from tasks import backends
from tasks.autoscale.activator import Activator
from tasks.autoscale.signals import InstanceSample, TtftWindow, read_instance
from tasks.autoscale.usage import UsageMeter
from tasks.traffic.interface import commit_routes

__all__ = ["HOLDER", "Autoscaler"]

log = logging.getLogger(__name__)

HOLDER = "autoscaler"  # the rollout lock's holder name while a scale action runs
MAX_BACKOFF_S = 600.0


def _emit(event: str, model_id: str, version: str, payload: dict) -> None:
    """A Prefect event on the model's resource; a stack without a Prefect API gets none."""
    if not os.environ.get("PREFECT_API_URL"):
        return
    try:
        from prefect.events import emit_event

        emit_event(event=event, resource={"prefect.resource.id": f"modelops.model.{model_id}",
                                          "modelops.version": version}, payload=payload)
    except Exception as e:  # noqa: BLE001 - an event is a report; the decision stands without it
        log.warning("could not emit %s for %s %s: %s", event, model_id, version, e)


class _Version:
    """What the loop keeps per serving version between ticks."""

    def __init__(self, policy: Scaling, ttft_window_s: float) -> None:
        self.policy = policy
        self.recommender = Recommender(policy)
        self.ttft = TtftWindow(ttft_window_s)
        self.missing = False  # the last tick lacked data (logged once per episode)
        self.failures = 0
        self.retry_at = 0.0
        self.last_error = ""
        self.finished: dict[str, float] = {}  # requests finished per instance at the last read (min: 0)


class Autoscaler:
    """The control loop (see the module docstring). :meth:`tick` once per interval; :meth:`run`
    loops until ``stop()`` returns True.

    Args:
        settings: default :func:`get_settings`.
        clock: monotonic seconds (tests give their own).
        parts: ``(registry, router, provider)``; default those of the settings
            (:func:`tasks.backends.parts`).
    """

    def __init__(self, settings: Settings | None = None, clock: Callable[[], float] = time.monotonic,
                 parts: tuple | None = None) -> None:
        self.settings = settings or get_settings()
        self.clock = clock
        self.registry, self.router, self.provider = parts or backends.parts(self.settings)
        self._versions: dict[tuple[str, str], _Version] = {}
        self._acting: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="scale")
        self._http = httpx.Client()
        self._wake = threading.Event()
        self.usage = UsageMeter(self.registry, self.router, self._http)
        self.activator = Activator(self.registry, self.settings.router_url.removesuffix("/v1"),
                                   self.settings.activator_socket, self.settings.router_hold_s,
                                   wake=lambda model_id, version: self._wake.set(), backoff=self._backoff)

    # -- the loop ------------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool]) -> None:
        """Serve the activator and tick every ``autoscale_interval_s`` (at once when a request is
        held) until ``stop()``; then wait for actions in flight."""
        self.activator.start()
        log.info("autoscaler started: every %.1f s, at most %d instances per version",
                 self.settings.autoscale_interval_s, self.settings.autoscale_max_instances)
        try:
            while not stop():
                t0 = self.clock()
                self._wake.clear()
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - a registry hiccup must not end the loop
                    log.exception("autoscaler tick failed; trying again next interval")
                try:
                    self.usage.tick()
                except Exception:  # noqa: BLE001 - nor may a usage read
                    log.exception("usage read failed; trying again next interval")
                self._wake.wait(max(0.0, self.settings.autoscale_interval_s - (self.clock() - t0)))
        finally:
            self.activator.stop()
            self.close()

    def settle(self) -> None:
        """Wait for the scale actions in flight to end (their outcome is in the registry)."""
        for fut in list(self._acting.values()):
            fut.result()

    def close(self) -> None:
        """Wait for the scale actions in flight, then release the HTTP client."""
        self._pool.shutdown(wait=True)
        self._http.close()

    def tick(self) -> list[tuple[str, str, int, int]]:
        """One pass over every serving version; returns the actions started, each
        ``(model_id, version, before, after)``."""
        now = self.clock()
        for model_id, fut in list(self._acting.items()):
            if fut.done():
                del self._acting[model_id]
        serving = {(v.model_id, v.version): v for v in self.registry.versions() if v.state == "serving"}
        for key in set(self._versions) - set(serving):
            del self._versions[key]
        started = []
        for (model_id, version), row in serving.items():
            policy = row.manifest.scaling
            state = self._versions.get((model_id, version))
            if state is None or state.policy != policy:
                state = self._versions[(model_id, version)] = _Version(policy, self.settings.autoscale_ttft_window_s)
            if model_id in self._acting:
                continue
            live = [i for i in self.registry.instances(model_id, version) if i.state in LIVE_INSTANCE_STATES]
            why = None
            if not live:
                # At zero by its policy, with requests held: one starts now. Otherwise being
                # provisioned or restored by a flow, or gone: not the autoscaler's to start.
                held = self.activator.demand(model_id, version) if policy.min == 0 else 0
                if not held or now < state.retry_at:
                    continue
                after, value, why = 1, None, f"scale from zero: {held} request(s) held by the router"
            else:
                after, value = self._decide(now, state, live)
                if after == len(live) or now < state.retry_at:
                    continue
            if self.registry.try_lock_rollout(model_id, HOLDER, os.getpid()):
                state.recommender.reset()  # a rollout holds the model: decide afresh once it ends
                continue
            started.append((model_id, version, len(live), after))
            self._acting[model_id] = self._pool.submit(self._act, model_id, version, len(live), after, value, state,
                                                       why)
        return started

    def _backoff(self, model_id: str, version: str) -> tuple[float, str] | None:
        """Seconds until the version's next start and why its last one failed, while it backs off."""
        state = self._versions.get((model_id, version))
        if state is None or not state.failures or (left := state.retry_at - self.clock()) <= 0:
            return None
        return left, state.last_error

    def _decide(self, now: float, state: _Version, live) -> tuple[int, float | None]:
        """The count to go to and the signal's per-instance value (None when not read)."""
        policy, current = state.policy, len(live)
        if not policy.autoscaled:
            return max(current, policy.min), None
        samples: dict[str, InstanceSample] = {}
        for inst in live:
            sample = read_instance(inst.endpoints.get("metrics", ""), self._http) if inst.state == "running" else None
            if sample is None:
                if not state.missing:
                    log.warning("%s %s: no metrics from instance %s (%s); no scaling decision until every "
                                "instance answers", inst.model_version.model_id, inst.model_version.version,
                                inst.name, inst.state)
                state.missing = True
                state.recommender.reset()
                return max(current, policy.min), None
            samples[inst.name] = sample
        if state.missing:
            log.info("%s %s: every instance answers again", live[0].model_version.model_id,
                     live[0].model_version.version)
            state.missing = False
        state.ttft.add(now, samples)
        value = None
        if policy.target is None:  # {min: 0, max: 1}: idle or not decides
            desired = current
        else:
            signal = policy.target.signal
            value = (state.ttft.p90() if signal == "ttft_p90_s" else
                     sum(getattr(s, signal) for s in samples.values()) / len(samples))
            desired = desired_instances(policy, current, value)
        if policy.min == 0:
            # Zero only for a version with nothing to do: no request running, waiting or finished
            # since the last read (an instance read for the first time counts as busy).
            busy = any(s.running or s.waiting or state.finished.get(name) != s.finished for name, s in samples.items())
            state.finished = {name: s.finished for name, s in samples.items()}
            desired = max(desired, 1) if busy else 0
        state.recommender.observe(now, desired)
        return state.recommender.decide(now, current), value

    # -- acting --------------------------------------------------------------------------------
    def _act(self, model_id: str, version: str, before: int, after: int, value: float | None,
             state: _Version, why: str | None = None) -> None:
        """Bring the version from ``before`` to ``after`` instances under the model's lock (``why``:
        the reason recorded, default the signal against its target)."""
        direction = "up" if after > before else "down"
        signal = state.policy.target.signal if state.policy.target is not None else "min"
        if why is not None:
            signal = "held" if before == 0 else signal
        elif after == 0:  # whatever the target's signal read: only idleness takes a version to zero
            signal, why = "idle", f"no request for {state.policy.scale_down_window_s:g} s (scale to zero)"
        elif value is not None and state.policy.target is not None:
            why = f"{signal} {value:.3g} per instance against target {state.policy.target.value:g}"
        else:
            why = f"policy min {state.policy.min}"
        log.info("%s %s: scaling %s from %d to %d instance(s): %s", model_id, version, direction, before, after, why)
        decision = self.registry.record_scale(model_id, version, before, after, signal, value, why)
        payload = {"version": version, "from": before, "to": after, "signal": signal, "value": value, "reason": why}
        t0 = time.monotonic()
        try:
            package = image = None
            if after > before:
                from tasks.image import build_runtime_image

                package = sealed_package(self.settings, model_id, version)
                if package is None:
                    raise FileNotFoundError(f"its sealed package ({self.settings.packages_dir / model_id / version}) "
                                            "is gone")
                image = build_runtime_image(self.settings)
            self.provider.scale(model_id, version, after, package, image,
                                unroute=lambda: commit_routes(self.registry, self.router))
            commit_routes(self.registry, self.router)
        except Exception as e:  # noqa: BLE001 - reported, backed off; the version serves on what it has
            seconds = round(time.monotonic() - t0, 2)
            state.failures += 1
            wait = min(MAX_BACKOFF_S, self.settings.autoscale_backoff_s * 2 ** (state.failures - 1))
            state.retry_at = self.clock() + wait
            detail = f"{' '.join(str(e).split())[:1500]}; next try in {wait:.0f} s"
            state.last_error = ' '.join(str(e).split())[:300]
            log.error("%s %s: scaling %s to %d failed after %.1f s: %s", model_id, version, direction, after, seconds,
                      detail)
            self.registry.finish_scale(decision, "failed", seconds, detail)
            _emit("modelops.scale.failed", model_id, version, {**payload, "error": detail, "seconds": seconds})
            try:
                commit_routes(self.registry, self.router)  # whatever did start is routed
            except Exception as e2:  # noqa: BLE001
                log.error("%s: router not updated after the failed scale: %s", model_id, e2)
        else:
            seconds = round(time.monotonic() - t0, 2)
            state.failures = 0
            log.info("%s %s: now %d instance(s) (%.1f s)", model_id, version, after, seconds)
            self.registry.finish_scale(decision, "done", seconds)
            _emit(f"modelops.scale.{direction}", model_id, version, {**payload, "seconds": seconds})
        finally:
            state.recommender.reset()
            self.registry.unlock_rollout(model_id, HOLDER)
