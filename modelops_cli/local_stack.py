"""The local stack's long-running processes: Prefect server + worker, moto's S3 server (its
buckets kept on disk, modelops_cli/local_s3.py) and the autoscaler (tasks/autoscale/).

Each process is started in its own session with a pid file in ``<home>/run`` and stopped by
that pid, so ``modelops stack down`` stops exactly what ``stack up`` started. (HAProxy and the
serving instances are managed by their own modules; the CLI composes them.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from modelops.errors import ModelopsError
from modelops.process import pid_alive, stop_process_group
from modelops.settings import REPO_ROOT, Settings
from modelops.tenancy import stack_secret, without_prefect_auth

__all__ = ["AUTOMATIONS_DIR", "Daemon", "configured_prefect_api_url", "daemons", "ensure_automations",
           "flow_run_processes", "prefect_auth_string", "prefect_env", "prefect_http", "wait_http"]

_BIN = Path(sys.executable).parent
AUTOMATIONS_DIR = REPO_ROOT / "deployments" / "automations"


def prefect_env(settings: Settings) -> dict[str, str]:
    """Environment that points Prefect's CLI and clients at the local server, with its auth
    string: the server requires it (PREFECT_SERVER_API_AUTH_STRING) and its clients, the worker's
    flow runs included, send it (PREFECT_API_AUTH_STRING)."""
    auth = prefect_auth_string(settings)
    return {
        **os.environ,
        "PREFECT_API_URL": settings.prefect_api_url,
        "PREFECT_SERVER_API_AUTH_STRING": auth,
        "PREFECT_API_AUTH_STRING": auth,
        "PREFECT_HOME": str(settings.home_dir / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": settings.prefect_api_url,
        "MODELOPS_REPO": str(REPO_ROOT),
        "MODELOPS_HOME": str(settings.home_dir),
    }


def configured_prefect_api_url(cwd: Path | None = None) -> tuple[str, str] | None:
    """The Prefect API URL configured outside the environment, and where: ``(url, source)``,
    or None when there is none.

    Read without importing Prefect (whose settings are fixed at import), in Prefect's order of
    precedence below environment variables (docs.prefect.io, "Settings and profiles"): ``.env``
    in ``cwd`` (parsed by python-dotenv, as Prefect does), ``prefect.toml`` (``[api] url``),
    ``pyproject.toml`` (``[tool.prefect.api] url``), then the active profile (``PREFECT_PROFILE``
    or the file's ``active``) of the profiles file (``PREFECT_PROFILES_PATH``, also read from
    ``.env``; default ``$PREFECT_HOME/profiles.toml``, ``~/.prefect/profiles.toml``). A file that
    does not parse is skipped: Prefect itself says what is wrong with it.
    """
    import tomllib

    from dotenv import dotenv_values

    def toml(path: Path) -> dict:
        try:
            return tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError):
            return {}

    def api_url(table: object) -> str | None:
        url = table.get("api", {}).get("url") if isinstance(table, dict) and isinstance(table.get("api"), dict) \
            else None
        return url if isinstance(url, str) and url else None

    cwd = cwd or Path.cwd()
    dotenv = dotenv_values(cwd / ".env") if (cwd / ".env").is_file() else {}
    if dotenv.get("PREFECT_API_URL"):
        return dotenv["PREFECT_API_URL"], str(cwd / ".env")
    if url := api_url(toml(cwd / "prefect.toml")):
        return url, str(cwd / "prefect.toml")
    if url := api_url(toml(cwd / "pyproject.toml").get("tool", {}).get("prefect")):
        return url, str(cwd / "pyproject.toml")
    env = {**dotenv, **os.environ}
    home = Path(env.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    path = Path(env.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    profiles = toml(path)
    name = env.get("PREFECT_PROFILE") or profiles.get("active")
    profile = profiles.get("profiles", {}).get(name) if isinstance(profiles.get("profiles"), dict) else None
    url = profile.get("PREFECT_API_URL") if isinstance(profile, dict) else None
    return (url, f"{path} (profile {name})") if isinstance(url, str) and url else None


def prefect_auth_string(settings: Settings) -> str:
    """The local Prefect server's API auth string, ``modelops:<43 URL-safe characters>``, made on
    first use in ``settings.prefect_auth_file`` (mode 600). Prefect's form is ``user:password``
    (HTTP Basic); its UI's sign-in page asks for it whole."""
    return stack_secret(settings.prefect_auth_file, prefix="modelops:")


def prefect_http(settings: Settings, timeout: float = 30) -> httpx.Client:
    """An HTTP client for the local Prefect server's REST API: ``base_url`` its API URL (paths
    are relative, e.g. ``/flow_runs/filter``), sending its auth string.
    For the few calls Prefect's own client has no method for, and for scripts and tests."""
    import base64

    # As Prefect's own client sends it: the base64 of the whole string (prefect/client/orchestration).
    token = base64.b64encode(prefect_auth_string(settings).encode()).decode()
    return httpx.Client(base_url=settings.prefect_api_url, headers={"Authorization": f"Basic {token}"},
                        timeout=timeout)


def ensure_automations(settings: Settings, directory: Path = AUTOMATIONS_DIR) -> dict[str, str]:
    """Make the local Prefect server hold each automation of ``directory`` (``*.json``, the body
    of Prefect's ``POST /api/automations/``) as the file says, matched by name: created when
    missing, replaced (``PUT``) when the file changed since, else left alone. The file's sha256
    travels as a tag (``modelops-sha256:<12 hex>``) so a change is seen without comparing the
    server's normalized form.

    Returns:
        ``{name: "created" | "updated" | "unchanged"}``.

    Raises:
        ModelopsError: a file is not an automation, the server is unreachable, or it refused one
            (its answer is in the message).
    """
    import hashlib
    import json

    done: dict[str, str] = {}
    with prefect_http(settings) as api:
        for path in sorted(directory.glob("*.json")):
            try:
                body = json.loads(path.read_text())
                name = body["name"]
            except (ValueError, KeyError, TypeError) as e:
                raise ModelopsError(f"{path}: not an automation (JSON with a name): {e}") from None
            stamp = f"modelops-sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"
            body["tags"] = [*body.get("tags", []), stamp]
            try:
                found = api.post("/automations/filter", json={"automations": {"name": {"any_": [name]}}})
                found.raise_for_status()
                existing = found.json()
                if existing and stamp in existing[0].get("tags", []):
                    done[name] = "unchanged"
                    continue
                if existing:
                    r, done[name] = api.put(f"/automations/{existing[0]['id']}", json=body), "updated"
                else:
                    r, done[name] = api.post("/automations/", json=body), "created"
            except httpx.HTTPError as e:
                raise ModelopsError(f"could not create the automation {path.name} at {settings.prefect_api_url}: "
                                    f"{e}") from None
            if r.status_code >= 400:
                raise ModelopsError(f"Prefect refused the automation {path.name}: HTTP {r.status_code} {r.text[:500]}")
    return done


def flow_run_processes(settings: Settings) -> list[int]:
    """Pids of this stack's flow run processes (``python -m prefect.engine`` with this
    ``MODELOPS_HOME``). Prefect's process worker starts each in a session of its own, so they
    outlive a stopped worker; ``modelops down`` stops them by these pids (Linux ``/proc``)."""
    home = str(settings.home_dir).encode()
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if b"prefect.engine" not in cmd:
                continue
            env = dict(kv.partition(b"=")[::2] for kv in (proc / "environ").read_bytes().split(b"\0") if kv)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if env.get(b"MODELOPS_HOME") == home:
            pids.append(int(proc.name))
    return sorted(pids)


def wait_http(url: str, timeout: float, what: str, pid: int | None = None, log: Path | None = None) -> None:
    """Poll ``url`` until it answers < 500, the process ``pid`` dies, or ``timeout`` seconds pass.

    Raises:
        ModelopsError: naming ``what`` and the log file to read.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid is not None and not pid_alive(pid):
            break
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log and log.exists() else ""
    raise ModelopsError(f"{what} did not come up at {url} within {timeout:.0f} s; see {log}\n{tail}")


class Daemon:
    """A background process with a pid file; ``health_url`` tells when it is up; ``prefect``:
    whether it talks to the Prefect server (only then does it get the API's credentials);
    ``env``: its whole environment, instead of :func:`prefect_env` of ``settings`` (a region's
    processes: the stack's Prefect server and auth, the region's ``MODELOPS_*``)."""

    def __init__(self, name: str, cmd: list[str], settings: Settings, health_url: str | None = None,
                 startup_timeout: float = 60.0, prefect: bool = True, env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.settings = name, cmd, settings
        self.health_url, self.startup_timeout, self.prefect, self.env = health_url, startup_timeout, prefect, env
        self.pidfile = settings.run_dir / f"{name}.pid"
        self.log = settings.log_dir / f"{name}.log"

    def pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def start(self) -> bool:
        """Start unless running; return True if it was started now."""
        if self.pid():
            return False
        self.settings.run_dir.mkdir(parents=True, exist_ok=True)
        self.settings.log_dir.mkdir(parents=True, exist_ok=True)
        env = self.env or prefect_env(self.settings)
        with self.log.open("ab") as out:
            proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env if self.prefect else without_prefect_auth(env), cwd=REPO_ROOT,
                                    start_new_session=True)
        self.pidfile.write_text(str(proc.pid))
        if self.health_url:
            wait_http(self.health_url, self.startup_timeout, self.name, proc.pid, self.log)
            # Another process on the port (another stack's) answers the health check too, while
            # this one exits on "address in use": the answer counts only if this one still runs.
            time.sleep(0.5)
        if proc.poll() is not None:
            self.pidfile.unlink(missing_ok=True)
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-5:]) if self.log.exists() else ""
            raise ModelopsError(f"{self.name} exited (status {proc.returncode}) as it started; if its port is taken, "
                                f"give it another (MODELOPS_S3_PORT, MODELOPS_PREFECT_PORT, MODELOPS_BATCH_PORT); see {self.log}\n{tail}")
        return True

    def stop(self, timeout: float = 20.0) -> bool:
        """SIGTERM the process group, SIGKILL after ``timeout``; return True if it was running."""
        pid = self.pid()
        self.pidfile.unlink(missing_ok=True)
        return bool(pid) and stop_process_group(pid, timeout)


def daemons(settings: Settings) -> dict[str, Daemon]:
    """The stack's daemons in start order: s3 (moto), prefect-server, prefect-worker, autoscaler
    (tasks/autoscale/: started once HAProxy runs and the stopped versions serve again), batch-api
    (tasks/batch/)."""
    return {
        # moto's S3 server, its buckets kept in <home>/s3 across `down`/`up` (modelops_cli/local_s3.py).
        "s3": Daemon("s3", [str(_BIN / "python"), "-m", "modelops_cli.local_s3", "--host", "127.0.0.1", "--port",
                            str(settings.s3_port), "--state", str(settings.home_dir / "s3" / "state.pickle")],
                     settings, health_url=f"{settings.s3_endpoint}/moto-api/", startup_timeout=300, prefect=False),
        "prefect-server": Daemon(
            "prefect-server",
            [str(_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(settings.prefect_port)],
            settings, health_url=f"{settings.prefect_api_url}/health", startup_timeout=120),
        "prefect-worker": Daemon(
            "prefect-worker",
            [str(_BIN / "prefect"), "worker", "start", "--pool", settings.work_pool, "--type", "process"],
            settings),
        "autoscaler": Daemon("autoscaler", [str(_BIN / "python"), "-m", "tasks.autoscale"], settings),
        # OpenAI's Files and Batches API behind the router; it starts batch-inference flow runs.
        "batch-api": Daemon("batch-api", [str(_BIN / "python"), "-m", "tasks.batch"], settings,
                            health_url=f"http://127.0.0.1:{settings.batch_port}/health"),
    }
