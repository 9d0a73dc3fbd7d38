"""The CLI's Prefect side: which API server it talks to, following flow runs to their end,
and their logs. Prefect is imported inside the functions, after :func:`prefect_target` chose the server
(Prefect reads its settings once, at import)."""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import typer
from rich.text import Text

from modelops.settings import Settings, get_settings
from modelops_cli.output import console, err, fail, print_json

__all__ = ["StageLog", "flow_run_logs", "flow_run_url", "follow", "level_name", "prefect_target", "report_state",
           "require_prefect"]

_prefect_source = ""  # where PREFECT_API_URL came from (set by prefect_target), for error messages


def prefect_target() -> None:
    """Point Prefect at the local stack's server when it is up and ``PREFECT_API_URL`` is unset.

    The environment wins; then the local stack, when its server answers ``/api/health``; otherwise the server configured
    in ``.env``, ``prefect.toml``, ``pyproject.toml`` or the active profile (read as Prefect reads
    them, and exported so that every message names it). When the stack wins over a configured
    server, stderr says so, naming both and how to choose. For the stack's server it also sets
    the stack's auth string (``PREFECT_API_AUTH_STRING``) unless the environment has one. Runs
    before any command imports Prefect: Prefect reads its settings once, at import.
    """
    import socket

    import httpx

    from modelops_cli.local_stack import configured_prefect_api_url

    global _prefect_source
    if os.environ.get("PREFECT_API_URL"):
        _prefect_source = "PREFECT_API_URL in the environment"
        try:
            _stack_auth(get_settings(), os.environ["PREFECT_API_URL"])
        except ValueError:
            pass  # settings that don't load are reported by the command that needs them
        return
    try:
        settings = get_settings()
        with socket.create_connection(("127.0.0.1", settings.prefect_port), timeout=0.5):
            pass  # fast path: nothing listens (the usual case without a stack)
        # Something listens: the stack's Prefect server only if it answers Prefect's /health.
        if httpx.get(f"{settings.prefect_api_url}/health", timeout=2).status_code != 200:
            raise OSError("not a Prefect server")
    except (OSError, ValueError, httpx.HTTPError):
        # No local stack: the configured server if any (exported, so every message names the
        # server Prefect uses), else commands that need one say so; --local runs go ephemeral.
        if configured := configured_prefect_api_url():
            os.environ["PREFECT_API_URL"], _prefect_source = configured
        return
    os.environ["PREFECT_API_URL"], _prefect_source = settings.prefect_api_url, "the local stack"
    os.environ.setdefault("PREFECT_HOME", str(settings.home_dir / "prefect"))
    _stack_auth(settings, settings.prefect_api_url)
    configured = configured_prefect_api_url()
    if configured and configured[0].rstrip("/") != settings.prefect_api_url.rstrip("/"):
        err.print(f"note: using the local stack's Prefect server {settings.prefect_api_url}, not {configured[0]} "
                  f"from {configured[1]}; set PREFECT_API_URL to choose")


def _stack_auth(settings: Settings, api_url: str) -> None:
    """Send the local stack's auth string (Settings.prefect_auth_file) when
    ``api_url`` is the stack's server and the environment sets none. Read, never made: a stack
    that was never started has none, and a server started without one ignores it."""
    if os.environ.get("PREFECT_API_AUTH_STRING") or api_url.rstrip("/") != settings.prefect_api_url.rstrip("/"):
        return
    try:
        secret = settings.prefect_auth_file.read_text().strip()
    except OSError:
        return
    if secret:
        os.environ["PREFECT_API_AUTH_STRING"] = secret  # the whole auth string (local_stack.prefect_auth_string)


def flow_run_url(settings: Settings, flow_run_id: str) -> str:
    """The flow run's page in the Prefect UI of the server this CLI talks to: in its default UI
    (Prefect 3.9's V2, under ``/v2``, where ``/`` leads, and which opens the tab a link names:
    ``?tab=Artifacts``). The unprefixed ``/runs/flow-run/<id>`` is the previous UI, which ignores
    that parameter (tests/integration/test_ui_smoke.py)."""
    api = os.environ.get("PREFECT_API_URL") or settings.prefect_api_url
    return f"{api.removesuffix('/').removesuffix('/api')}/v2/runs/flow-run/{flow_run_id}"


class StageLog:
    """What ``announce --wait`` says of a flow run's stages (its task runs) as they go: a line
    when one starts running, and one when it ends, with its time, or the cause of a failure."""

    def __init__(self) -> None:
        self.said: dict = {}  # task run id -> the last state said

    def lines(self, task_runs) -> list[str]:
        """New lines for ``task_runs`` (Prefect TaskRun objects, in any order)."""
        out = []
        for t in sorted(task_runs, key=lambda t: (t.start_time or t.expected_start_time or t.created, t.name)):
            if t.state is None or t.state.name in ("Scheduled", "Pending") or self.said.get(t.id) == t.state.name:
                continue
            if t.task_key.startswith("prefect.deployments.flow_runs.run_deployment."):
                continue  # Prefect's stand-in for a child flow run: the task that started it says it better
            self.said[t.id] = t.state.name
            stage = re.sub(r"-[0-9a-f]+$", "", t.name)  # Prefect names a task run <task>-<n> (or a hex key)
            if not t.state.is_final():
                out.append(f"  {stage}: {t.state.name.lower()}")
            elif t.state.is_completed():
                out.append(f"  {stage}: completed in {t.total_run_time.total_seconds():.0f} s")
            else:
                cause = " ".join((t.state.message or "").split())[:300]
                out.append(f"  {stage}: {t.state.name.lower()}" + (f": {cause}" if cause else ""))
        return out


def follow(event_id: str, settings: Settings, timeout: float, wait: bool = True, as_json: bool = False,
            deployment: str = "model-lifecycle", match=None, extra: dict | None = None) -> None:
    """Find the flow run the event (or ``match(run)``) started, print its URL, and with ``wait``
    follow it to a final state (exit 1 unless it completed)."""
    import anyio
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterId,
    )

    match = match or (lambda r: r.parameters.get("announcement_id") == event_id)
    say = (lambda msg: None) if as_json else console.print

    async def find_and_wait():
        async with get_client() as client:
            deadline = time.monotonic() + timeout
            run = None
            while run is None:
                if time.monotonic() > deadline:
                    return None, f"no flow run of {deployment} was created within {timeout:.0f} s (is the deployment "\
                                 "deployed, with its trigger, and a worker running? run `modelops up`)"
                runs = await client.read_flow_runs(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])),
                    flow_run_filter=FlowRunFilter(), limit=50,
                    sort="EXPECTED_START_TIME_DESC")
                run = next((r for r in runs if match(r)), None)
                if run is None and event_id and (refused := await _trigger_failure(client, event_id)):
                    return None, f"the server made no flow run of {deployment} for this announcement: {refused}"
                if run is None:
                    await anyio.sleep(1)
            say(f"flow run {run.name}: {flow_run_url(settings, str(run.id))}")
            if not wait:
                return run, None
            last, name, stages = None, run.name, StageLog()
            while True:
                run = await client.read_flow_run(run.id)
                lines = stages.lines(await client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))))
                final = bool(run.state and run.state.is_final())
                for line in lines if final else ():  # the stages' ends before the run's own
                    say(line)
                if run.state and run.state.name != last:
                    last = run.state.name
                    # The flow names its run when it starts (e.g. all-minilm-l6-v2-1): the UI shows that name.
                    say(f"  state: {last}" + (f" (flow run {run.name})" if run.name != name else ""))
                    name = run.name
                for line in () if final else lines:
                    say(line)
                if final:
                    return run, None
                if time.monotonic() > deadline:
                    return run, f"flow run still {run.state.name if run.state else '?'} after {timeout:.0f} s"
                await anyio.sleep(2)

    run, problem = anyio.run(find_and_wait)
    if as_json:
        print_json({**(extra or {}), "event_id": event_id or None, "flow_run_id": str(run.id) if run else None,
                     "flow_run_url": flow_run_url(settings, str(run.id)) if run else None,
                     "state": run.state.name if run and run.state else None,
                     "message": problem or (run.state.message if run and run.state else None)})
        if problem or (wait and not run.state.is_completed()):
            raise typer.Exit(1)
        return
    if problem:
        fail(problem)
    if not wait:
        return
    if run.state.is_completed():
        console.print(Text("completed: ", style="green") + Text(run.state.message or ""))
    else:
        fail(f"flow run {run.state.name}: {run.state.message}\n  see {flow_run_url(settings, str(run.id))}")


async def _trigger_failure(client, event_id: str) -> str | None:
    """Why the server's automation made no flow run for event ``event_id``: the ``reason`` of its
    ``prefect.automation.action.failed`` event, which names that event as its ``triggering-event``
    (prefect/server/events/actions.py, Prefect 3.9), e.g. a payload the deployment's parameter
    schema refuses, or a deployment that is gone; None while there is none."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

    page = await client.read_events(filter=EventFilter(
        event=EventNameFilter(name=["prefect.automation.action.failed"]),
        related=EventRelatedFilter(resources_in_roles=[(f"prefect.event.{event_id}", "triggering-event")])), limit=50)
    # Only a run-deployment action's failure means no flow run: another automation on the same
    # event (a user's notification, say) failing says nothing about the lifecycle's run.
    failed = [e for e in page.events if e.payload.get("action_type") == "run-deployment"]
    if not failed:
        return None
    return " ".join(str(failed[0].payload.get("reason") or "the automation's action failed").split())[:1000]


def _running_stack_port() -> int | None:
    """The port of this home's running Prefect server (its pid file, its command line's
    ``--port``), when it runs on another port than the settings say; else None."""
    from modelops.process import pid_alive

    settings = get_settings()
    try:
        pid = int((settings.run_dir / "prefect-server.pid").read_text())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if pid_alive(pid) else []
        port = int(cmd[cmd.index(b"--port") + 1])
    except (OSError, ValueError, IndexError):
        return None
    return port if port != settings.prefect_port else None


def require_prefect(local_hint: bool = True, local_run: bool = False) -> None:
    """Exit 1 unless the Prefect API this CLI uses answers ``/health`` and takes its credentials,
    saying where its URL came from and what to do. ``local_run``: a --local run, which needs a
    server only when one is configured (else Prefect's ephemeral API records the run)."""
    import base64

    import httpx

    url = os.environ.get("PREFECT_API_URL")
    if local_run and not url:
        return
    url = url or get_settings().prefect_api_url
    try:
        httpx.get(f"{url}/health", timeout=5).raise_for_status()
        # /health answers without credentials (Prefect exempts it); /admin/version does not. Prefect
        # Cloud's API keys (PREFECT_API_KEY) are Prefect's client's business: not checked here.
        auth = os.environ.get("PREFECT_API_AUTH_STRING")
        headers = {"Authorization": f"Basic {base64.b64encode(auth.encode()).decode()}"} if auth else {}
        if not os.environ.get("PREFECT_API_KEY") and \
                httpx.get(f"{url}/admin/version", headers=headers, timeout=5).status_code == 401:
            fail(f"Prefect API at {url} refused this CLI's credentials (401): set PREFECT_API_AUTH_STRING to the "
                 f"server's auth string (the local stack's is in {get_settings().prefect_auth_file})")
        return
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        problem = "is not a valid URL" if isinstance(e, (httpx.InvalidURL, httpx.UnsupportedProtocol)) \
            else "is not reachable"
    if _prefect_source in ("", "the local stack"):
        if (port := _running_stack_port()) is not None:
            fail(f"Prefect API at {url} {problem}, but this stack's Prefect server runs on port {port} "
                 f"(MODELOPS_HOME {get_settings().home_dir}): set MODELOPS_PREFECT_PORT={port}, as `modelops up` had it")
        fail(f"Prefect API at {url} {problem}: run `modelops up`"
              + (" (or use --local to run the flow in-process)" if local_hint else ""))
    fail(f"Prefect API at {url} {problem} (the URL comes from {_prefect_source}): fix or unset it there"
          + ("; a --local run records its flow run on that server too" if local_run else ""))


def report_state(state, as_json: bool, extra: dict) -> None:
    """Print a flow run's final state from an in-process (--local) run; exit 1 unless it completed.
    The JSON has the same keys as a followed run's."""
    if as_json:
        run_id = str(state.state_details.flow_run_id)
        print_json({**extra, "event_id": None, "flow_run_id": run_id,
                     "flow_run_url": flow_run_url(get_settings(), run_id), "state": state.name,
                     "message": state.message})
        if not state.is_completed():
            raise typer.Exit(1)
        return
    if state.is_completed():
        console.print(Text("completed: ", style="green") + Text(state.message or ""))
    else:
        fail(f"flow run {state.name}: {state.message}")


def flow_run_logs(settings: Settings, run_id: uuid.UUID, lines: int, as_json: bool) -> None:
    require_prefect(local_hint=False)
    import anyio
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.exceptions import ObjectNotFound

    async def read():
        async with get_client() as client:
            try:
                run = await client.read_flow_run(run_id)
            except ObjectNotFound:
                return None, []
            # The newest lines first, a page (the API's limit, 200) at a time.
            found, offset = [], 0
            while len(found) < lines:
                page = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])),
                                              limit=min(200, lines - len(found)), offset=offset,
                                              sort=LogSort.TIMESTAMP_DESC)
                found += page
                offset += len(page)
                if not page:
                    break
            return run, list(reversed(found))

    run, records = anyio.run(read)
    if run is None:
        fail(f"no flow run {run_id} on {os.environ.get('PREFECT_API_URL') or settings.prefect_api_url}", 2)
    records = records[-lines:]
    if as_json:
        print_json({"flow_run": run.name, "state": run.state.name if run.state else None,
                     "logs": [{"timestamp": r.timestamp.isoformat(), "level": level_name(r.level),
                               "message": r.message} for r in records]})
        return
    console.print(Text(f"==> flow run {run.name} ({run.state.name if run.state else '?'}): "
                       f"{flow_run_url(settings, str(run_id))} <==", style="bold"))
    for r in records:
        console.print(f"{r.timestamp:%H:%M:%S} {level_name(r.level):<7} {r.message}")


def level_name(level: int) -> str:
    import logging

    return logging.getLevelName(level)
