"""Local provider: each instance is a process group on this machine.

``python -m runtime.startup`` from the runtime image (tritonserver + OpenAI frontend) on four
free loopback ports, under a supervisor (:mod:`modelops.supervisor`) that leads the group and
starts the instance again, with back-off, when it dies after serving (its engine died: it exits
70/75). The leader's pid is kept in the registry and in ``<home>/run/instances/<name>.pid``;
``modelops stack down`` stops every recorded group.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

import httpx

from modelops.artifacts import Package, RuntimeImage
from modelops.errors import ModelLoadError, ProvisionError
from modelops.io_contract import ENGINE_DIED_TRANSIENT_EXIT
from modelops.manifest import Resources
from modelops.process import free_ports, pid_alive, stop_process_group
from modelops.registry import LIVE_INSTANCE_STATES, Registry
from modelops.supervisor import failure_cause, supervisor_command
from modelops.settings import REPO_ROOT, Settings, get_settings
from modelops.shadow import SHADOW_ROUTER_ENV
from modelops.tenancy import INSTANCE_SECRET_ENV, stack_secret, without_prefect_auth
from tasks.provision.interface import Endpoints, Provider

__all__ = ["LocalProvider", "free_ports", "plan_cores", "runtime_command", "runtime_env"]

log = logging.getLogger(__name__)


def runtime_command(image: RuntimeImage, package: Path, workdir: Path, openai: int, http: int, grpc: int,
                    metrics: int) -> list[str]:
    """The command line of one serving instance: ``runtime.startup`` in the image's interpreter
    on the given loopback ports (OpenAI, KServe HTTP, KServe gRPC, Triton metrics)."""
    return [str(image.python), "-m", "runtime.startup", "--package", str(package), "--workdir", str(workdir),
            "--openai-port", str(openai), "--http-port", str(http), "--grpc-port", str(grpc),
            "--metrics-port", str(metrics)]


def runtime_env(image: RuntimeImage, settings: Settings) -> dict[str, str]:
    """Environment of a serving instance (this one's, plus the image's and the KV cache size),
    without the Prefect API's credentials: what it runs (a model.py, a plugin) must not reach the
    control plane."""
    return {**without_prefect_auth(dict(os.environ)), **image.env(),
            "VLLM_CPU_KVCACHE_SPACE": str(settings.vllm_cpu_kvcache_gib)}


def plan_cores(cpus: float, available: Sequence[int], held: Iterable[Collection[int]]) -> list[int]:
    """The cores of a new instance whose manifest asks for ``cpus`` (``resources.cpus``): that
    many rounded up, at most every one of ``available`` (this process's CPU affinity), chosen
    among those the live instances hold least (``held``: each one's cores), the lower number
    first on a tie. Sorted. On this machine's 2 cores two instances of ``cpus: 1`` get one core
    each, and one of ``cpus: 2`` gets both; an instance asking for more than is free shares."""
    load = {c: 0 for c in available}
    for cores in held:
        for c in cores:
            if c in load:
                load[c] += 1
    want = min(len(load), max(1, math.ceil(cpus)))
    return sorted(sorted(load, key=lambda c: (load[c], c))[:want])


class LocalProvider(Provider):
    """Instances as local processes; see the module docstring."""

    def __init__(self, settings: Settings | None = None, registry: Registry | None = None) -> None:
        self.settings = settings or get_settings()
        self.registry = registry or Registry(self.settings.registry)
        self.instances_dir = self.settings.run_dir / "instances"

    def ensure_instance(self, package: Package, image: RuntimeImage) -> tuple[str, Endpoints]:
        for inst in self.registry.instances(package.model_id, package.version):
            if inst.state == "draining":  # on its way out (scale): never reused
                continue
            if pid_alive(inst.pid):
                log.info("instance %s (pid %d) is already running; reusing it", inst.name, inst.pid)
                endpoints = Endpoints(**inst.endpoints)
                self._wait_ready(inst.name, inst.pid, endpoints, Path(inst.log_path), None)
                return inst.name, endpoints
            self.registry.update_instance(inst.name, state="stopped")
        return self._start(package, image)

    def scale(self, model_id: str, version: str, count: int, package: Package | None, image: RuntimeImage | None,
              unroute: Callable[[], None] | None = None) -> None:
        """Bring ``version`` to ``count`` running instances: start more (needs ``package`` and
        ``image``), or take the newest ones out of the router (state ``draining``, then
        ``unroute()``), then drain and stop them all at once.

        Raises:
            ProvisionError: an instance needed for the count did not start, or one could not be
                stopped.
        """
        # A restarting instance (its supervisor brings it back) counts: scaling must not double it.
        running = [i for i in self.registry.instances(model_id, version)
                   if i.state in LIVE_INSTANCE_STATES and pid_alive(i.pid)]
        if count > len(running):
            if package is None or image is None:
                raise ProvisionError(f"cannot scale {model_id} {version} up to {count}: its package is not at hand")
            for _ in range(count - len(running)):
                self._start(package, image)
        surplus = [inst.name for inst in reversed(running[count:])]
        if surplus:
            for name in surplus:
                self.registry.update_instance(name, state="draining")
            if unroute is not None:
                unroute()
            self.stop_each(surplus)

    def _start(self, package: Package, image: RuntimeImage) -> tuple[str, Endpoints]:
        n = len(self.registry.instances(package.model_id, package.version, live=False)) + 1
        name = f"{package.model_id}-{package.version}-{n}"
        workdir = self.instances_dir / name
        workdir.mkdir(parents=True, exist_ok=True)
        self.settings.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.settings.log_dir / f"{name}.log"
        openai, http, grpc, metrics = free_ports(4)
        endpoints = Endpoints(
            openai=f"http://127.0.0.1:{openai}/v1",
            kserve_http=f"http://127.0.0.1:{http}",
            kserve_grpc=f"127.0.0.1:{grpc}",
            metrics=f"http://127.0.0.1:{openai}/metrics",  # merged: Triton's and vLLM's (runtime/frontend/metrics.py)
        )
        cores = self._cores(package, name)
        # Recorded before the process exists: a crash between here and the pid write leaves
        # a "starting" row that the next attempt marks stopped, never an unknown process.
        self.registry.add_instance(package.model_id, package.version, name, str(log_path))
        cmd = supervisor_command(name, f"http://127.0.0.1:{openai}/ready", log_path, self.settings.registry,
                                 runtime_command(image, package.path, workdir, openai, http, grpc, metrics), cores)
        with log_path.open("ab") as out:
            # The stack's secret: the instance takes requests only from the router and the
            # platform's checks (modelops/tenancy.py).
            env = {**runtime_env(image, self.settings),
                   INSTANCE_SECRET_ENV: stack_secret(self.settings.instance_secret_file),
                   # Where its frontend sends the copies of requests the router marks for a shadow.
                   **({SHADOW_ROUTER_ENV: f"unix:{self.settings.router_internal_socket}"}
                      if self.settings.router == "haproxy" else {})}
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                    start_new_session=True)
        (self.instances_dir / f"{name}.pid").write_text(str(proc.pid))
        self.registry.update_instance(name, pid=proc.pid, endpoints=endpoints.as_dict())
        log.info("started instance %s (pid %d) on cores %s, log %s", name, proc.pid, ",".join(map(str, cores)),
                 log_path)
        try:
            self._wait_ready(name, proc.pid, endpoints, log_path, proc)
        except ProvisionError:
            self.stop(name)
            raise
        return name, endpoints

    def _cores(self, package: Package, name: str) -> list[int]:
        """The new instance's cores (:func:`plan_cores`) for its manifest's ``resources.cpus``; vLLM
        binds its OpenMP threads within them and keeps one for the serving processes when there
        are several (its ``VLLM_CPU_OMP_THREADS_BIND=auto``: vllm/utils/ompmultiprocessing.py)."""
        row = self.registry.get_version(package.model_id, package.version)
        cpus = (row.manifest.resources if row is not None else Resources()).cpus
        held = []
        for inst in self.registry.instances():
            try:
                held.append(os.sched_getaffinity(inst.pid) if inst.pid else ())
            except OSError:  # gone since the registry was read
                pass
        available = sorted(os.sched_getaffinity(0))
        cores = plan_cores(cpus, available, held)
        if math.ceil(cpus) > len(available):
            log.warning("instance %s asks for %g cores; this process may use %d (%s): it gets those", name, cpus,
                        len(available), ",".join(map(str, available)))
        if shared := sorted({c for h in held for c in h} & set(cores)):
            log.warning("instance %s asks for %g cores and shares cores %s with live instances (this process may "
                        "use %s): they compete for them", name, cpus, ",".join(map(str, shared)),
                        ",".join(map(str, available)))
        return cores

    def _wait_ready(self, name: str, pid: int, endpoints: Endpoints, log_path: Path,
                    proc: subprocess.Popen | None) -> None:
        """Poll ``/ready`` until 200 (state running) or the provision timeout.

        Raises:
            ModelLoadError: the instance exited during startup and starting it again would fail
                the same way; ProvisionError: it exited with ENGINE_DIED_TRANSIENT_EXIT (its
                engine was killed from outside: worth one more start), or never turned ready.
        """
        deadline = time.monotonic() + self.settings.provision_timeout_s
        ready_url = endpoints.openai.removesuffix("/v1") + "/ready"
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                rc = proc.wait() if proc is not None else None
                failed = f"instance {name} exited during startup (exit status {rc}): {failure_cause(log_path)}\n" \
                         f"  (full log: {log_path})"
                raise ProvisionError(failed) if rc == ENGINE_DIED_TRANSIENT_EXIT else ModelLoadError(failed)
            try:
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    self.registry.update_instance(name, state="running")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise ProvisionError(f"instance {name} not ready after {self.settings.provision_timeout_s:.0f} s; see {log_path}")

    def is_alive(self, instance) -> bool:
        return bool(instance.pid) and pid_alive(instance.pid)

    def is_ready(self, instance) -> bool:
        if not self.is_alive(instance) or "openai" not in instance.endpoints:
            return False
        try:
            return httpx.get(instance.endpoints["openai"].removesuffix("/v1") + "/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, instance_name: str) -> None:
        for inst in self.registry.instances(live=False):
            if inst.name == instance_name:
                if pid_alive(inst.pid):
                    # SIGTERM drains the instance (in-flight requests finish), then the group goes.
                    stop_process_group(inst.pid, timeout=self.settings.drain_timeout_s + 15)
                self.registry.update_instance(instance_name, state="stopped")
                (self.instances_dir / f"{instance_name}.pid").unlink(missing_ok=True)
                log.info("stopped instance %s", instance_name)
                return
        raise KeyError(f"no instance named {instance_name!r}")
