"""The local provider's supervisor of one serving instance: what a kubelet's restart policy does
for a pod, for one process group on this machine.

    python -m modelops.supervisor --instance NAME --ready-url URL --log FILE [--cpus 0,1] -- COMMAND...

- With ``--cpus`` it runs on those cores, and so does everything it starts (CPU affinity is
  inherited): the instance's share of the machine (``resources.cpus``, chosen by the provider).
- It leads the instance's process group (the provider records its pid) and runs COMMAND, the
  runtime (``runtime.startup``), as its child, whose output goes where its own goes (the log).
- The child exits before it was ever ready (the model failed to load, the engine died during
  warm-up): the supervisor exits with the same status, so provisioning fails at once and decides
  whether to try again (tasks/provision/local.py).
- The child exits after it served, and nobody asked it to stop (its engine died: exit 70/75,
  runtime/startup.py): it is started again after a back-off of 1, 2, 4 ... s (at most 30 s), up
  to :data:`MAX_RESTARTS` times within :data:`RESTART_WINDOW_S`; then the supervisor gives up
  with the child's status (instance state ``failed``). The registry records each restart (``restarts``, ``last_exit``,
  state ``restarting`` until ``/ready`` answers 200 again, then ``running``): ``modelops
  status`` shows it.
- A restarted child that dies again before it is ready counts as one more death (the bound above).
- SIGTERM/SIGINT are passed to the child (the runtime drains), nothing is restarted after, and the
  supervisor exits 0 (a stop is no fault). A child that exits 0 unasked is recorded ``stopped``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["MAX_RESTARTS", "RESTART_WINDOW_S", "failure_cause", "supervisor_command"]

log = logging.getLogger("modelops.supervisor")

MAX_RESTARTS = 3  # within RESTART_WINDOW_S; a fourth death gives up (a crash loop is not serving)
RESTART_WINDOW_S = 600.0
BACKOFF_MAX_S = 30.0

# Most telling first: the runtime's own verdict on its engine (runtime/startup.py), Triton's
# model-load error, a Python exception line, any error line.
_CAUSES = (re.compile(r"(engine died (?:during warm-up|while serving): .*)"),
           re.compile(r"failed to load '[^']*' version \d+: (.*)"), re.compile(r"(\w+Error: .*)"),
           re.compile(r"(error: .*)"))


def failure_cause(log_path: Path, since: int = 0) -> str:
    """The most telling error line of a failed instance's log from byte ``since`` on (Triton
    prints its model-load error before pages of shutdown noise), else its last lines."""
    if not log_path.exists():
        return "no log was written"
    with log_path.open("rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").splitlines()
    for pattern in _CAUSES:
        for line in reversed(lines):
            if m := pattern.search(line):
                text = m.group(1).replace("\\n", " ").split("  At: ")[0]  # drop the Python traceback
                return " ".join(text.split()).strip('"')[:800]
    return "\n".join(lines[-10:])


def supervisor_command(instance: str, ready_url: str, log_path: Path, registry_url: str,
                       command: list[str], cpus: list[int] | None = None) -> list[str]:
    """The command line that runs ``command`` under a supervisor (this module, in the control
    plane's interpreter: it writes to the registry at ``registry_url``), on the cores ``cpus``
    (None: wherever this process may run)."""
    return [sys.executable, "-m", "modelops.supervisor", "--instance", instance, "--ready-url", ready_url,
            "--log", str(log_path), "--registry", registry_url,
            *(["--cpus", ",".join(map(str, cpus))] if cpus else []), "--", *command]


def _cores(text: str) -> list[int]:
    parts = text.split(",")
    if not all(re.fullmatch(r"[0-9]{1,5}", part) for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give core numbers separated by commas, e.g. 0,1")
    return sorted({int(part) for part in parts})


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


class _Supervisor:
    def __init__(self, instance: str, ready_url: str, command: list[str], log_path: Path | None, registry_url: str,
                 max_restarts: int = MAX_RESTARTS, backoff_s: float = 1.0) -> None:
        self.instance, self.ready_url, self.command, self.log_path = instance, ready_url, command, log_path
        self.registry_url = registry_url
        self.max_restarts, self.backoff_s = max_restarts, backoff_s
        self.stopping = threading.Event()
        self.child: subprocess.Popen | None = None
        self.served = False
        self._registry = None

    def registry(self):
        if self._registry is None:
            from modelops.registry import Registry

            self._registry = Registry(self.registry_url)
        return self._registry

    def _record(self, **fields) -> None:
        try:
            self.registry().update_instance(self.instance, **fields)
        except Exception as e:  # noqa: BLE001 - the registry being away must not stop the instance
            log.warning("supervisor: could not record %s in the registry: %s", fields, e)

    def on_signal(self, signum, _frame) -> None:
        self.stopping.set()
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)  # the runtime drains on the first SIGTERM, stops on the second

    def _watch_ready(self, child: subprocess.Popen, restarted: bool) -> None:
        import httpx

        while child.poll() is None and not self.stopping.is_set():
            try:  # httpx.HTTPError and InvalidURL: a URL main() checked can still fail to resolve
                if httpx.get(self.ready_url, timeout=2).status_code == 200:
                    self.served = True
                    if restarted:
                        self._record(state="running")
                    log.info("supervisor: %s ready%s", self.instance, " again after its restart" if restarted else "")
                    return
            except (httpx.HTTPError, httpx.InvalidURL):
                pass
            time.sleep(0.25)

    def run(self) -> int:
        deaths: list[float] = []
        restarts = 0
        while True:
            offset = self.log_path.stat().st_size if self.log_path is not None and self.log_path.exists() else 0
            try:
                self.child = subprocess.Popen(self.command)
            except OSError as e:
                log.error("supervisor: cannot start %s: %s", self.command[0], e)
                if restarts:
                    self._record(state="failed", last_exit=f"could not start again: {e}")
                return 127
            if self.stopping.is_set():  # a SIGTERM that came before the child existed
                self.child.terminate()
            threading.Thread(target=self._watch_ready, args=(self.child, restarts > 0), daemon=True).start()
            rc = self.child.wait()
            if self.stopping.is_set():  # stopped by us: ending on the signal passed on is no fault
                return 0 if rc in (0, -signal.SIGTERM, -signal.SIGINT) else rc
            if rc == 0:  # it stopped of its own accord (a SIGTERM sent to it, not to us)
                self._record(state="stopped")
                return rc
            if not self.served and not restarts:
                return rc  # never ready: provisioning decides (a restart would only repeat it)
            now = time.monotonic()
            deaths = [t for t in deaths if now - t < RESTART_WINDOW_S] + [now]
            cause = failure_cause(self.log_path, offset) if self.log_path is not None else ""
            last_exit = f"{_describe(rc)}: {cause}" if cause else _describe(rc)
            if not self.served:
                last_exit = "before it was ready again: " + last_exit
            if len(deaths) > self.max_restarts:
                log.error("supervisor: %s died %d times in %.0f s (%s); giving up", self.instance, len(deaths),
                          RESTART_WINDOW_S, last_exit)
                self._record(state="failed", last_exit=last_exit)
                return rc
            restarts += 1
            backoff = min(BACKOFF_MAX_S, self.backoff_s * 2.0 ** (len(deaths) - 1))
            log.warning("supervisor: %s exited (%s); restart %d in %.1f s", self.instance, last_exit, restarts,
                        backoff)
            self._record(state="restarting", restarts=restarts, last_exit=last_exit)
            self.served = False
            if self.stopping.wait(backoff):
                return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--instance", required=True, help="the instance's name in the registry")
    p.add_argument("--ready-url", required=True, help="its GET /ready URL")
    p.add_argument("--log", type=Path, default=None, help="its log file (for the cause of a death)")
    p.add_argument("--registry", required=True, help="the registry's SQLAlchemy URL (where restarts are recorded)")
    p.add_argument("--max-restarts", type=int, default=MAX_RESTARTS, help=f"within {RESTART_WINDOW_S:.0f} s")
    p.add_argument("--backoff", type=float, default=1.0, help="seconds before the first restart (doubles)")
    p.add_argument("--cpus", type=_cores, default=None, help="the cores it and its child run on, e.g. 0,1")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the instance's command after --")
    if not args.ready_url.startswith(("http://", "https://")):
        p.error(f"--ready-url {args.ready_url!r}: must be an http(s) URL of the instance's GET /ready")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cpus:
        allowed = sorted(os.sched_getaffinity(0))
        # Linux keeps the cores of a mask it has and drops the others silently: refuse instead.
        if missing := [c for c in args.cpus if c not in allowed]:
            p.error(f"--cpus {','.join(map(str, args.cpus))}: no core {','.join(map(str, missing))} here; this process "
                    f"may use cores {','.join(map(str, allowed))}")
        os.sched_setaffinity(0, args.cpus)
        log.info("instance %s runs on cores %s", args.instance, ",".join(map(str, args.cpus)))
    sup = _Supervisor(args.instance, args.ready_url, command, args.log, args.registry, args.max_restarts,
                      args.backoff)
    signal.signal(signal.SIGTERM, sup.on_signal)
    signal.signal(signal.SIGINT, sup.on_signal)
    rc = sup.run()
    return rc if rc >= 0 else 128 - rc  # a child killed by signal N: the shell's 128 + N


if __name__ == "__main__":
    sys.exit(main())
