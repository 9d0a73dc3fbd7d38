"""The CLI's scripting surface: which Prefect server it talks to, and errors under --json."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from modelops_cli import prefect_api
from modelops_cli.local_stack import configured_prefect_api_url

CLI = str(Path(sys.executable).parent / "modelops")


@pytest.fixture
def prefect_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """No Prefect setting in the environment, an empty working directory, profiles at a path we
    own; the environment is restored afterwards (_prefect_target writes to it)."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("PREFECT_")]:
        del os.environ[key]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    os.environ["PREFECT_PROFILES_PATH"] = str(tmp_path / "profiles.toml")
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)


def _prefect_resolves(work: Path) -> str | None:
    """The API URL Prefect itself resolves in ``work`` with this environment (a fresh process:
    Prefect reads its settings at import)."""
    out = subprocess.run([sys.executable, "-c", "from prefect.settings import get_current_settings as s; "
                          "print(s().api.url)"], cwd=work, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    url = out.stdout.strip().splitlines()[-1]
    return None if url == "None" else url


def test_configured_server_is_the_one_prefect_resolves(prefect_clean: Path):
    work = prefect_clean / "work"
    profiles = prefect_clean / "profiles.toml"
    steps = [
        ("no configuration", lambda: None),
        ("active profile", lambda: profiles.write_text(
            'active = "team"\n[profiles.team]\nPREFECT_API_URL = "http://prefect.team:4200/api"\n'
            '[profiles.other]\nPREFECT_API_URL = "http://other:4200/api"\n[profiles.bare]\n')),
        ("PREFECT_PROFILE picks another", lambda: os.environ.update(PREFECT_PROFILE="other")),
        ("a profile without a URL", lambda: os.environ.update(PREFECT_PROFILE="bare")),
        ("pyproject.toml", lambda: (work / "pyproject.toml").write_text(
            '[tool.prefect.api]\nurl = "http://pyproject:4200/api"\n')),
        ("prefect.toml over pyproject.toml", lambda: (work / "prefect.toml").write_text(
            '[api]\nurl = "http://project:4200/api"\n')),
        (".env with a comment and the key twice", lambda: (work / ".env").write_text(
            "# team\nexport PREFECT_API_URL=http://first:4200/api\n"
            "PREFECT_API_URL='http://dotenv:4200/api'  # the team server\n")),
    ]
    seen = []
    for what, change in steps:
        change()
        ours = configured_prefect_api_url(work)
        assert (ours[0] if ours else None) == _prefect_resolves(work), what
        seen.append(ours[0] if ours else None)
    assert seen == [None, "http://prefect.team:4200/api", "http://other:4200/api", None, "http://pyproject:4200/api",
                    "http://project:4200/api", "http://dotenv:4200/api"]
    assert configured_prefect_api_url(work)[1] == str(work / ".env")  # the source is named
    # A malformed prefect.toml stops Prefect itself with its own error; here it is skipped.
    (work / ".env").write_text("OTHER=1\n")
    (work / "prefect.toml").write_text("[api\n")
    assert configured_prefect_api_url(work) == ("http://pyproject:4200/api", str(work / "pyproject.toml"))


def test_the_local_stack_wins_over_a_configured_server_and_says_so(prefect_clean: Path, capsys):
    (prefect_clean / "profiles.toml").write_text('active = "t"\n[profiles.t]\nPREFECT_API_URL = "http://t:1/api"\n')
    os.environ["MODELOPS_HOME"] = str(prefect_clean / "home")
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):  # what the stack's Prefect server answers on /api/health
        def do_GET(self):
            self.send_response(200 if self.path == "/api/health" and healthy.is_set() else 404)
            self.end_headers()
            self.wfile.write(b"true")

        def log_message(self, *args):
            pass

    healthy = threading.Event()
    with ThreadingHTTPServer(("127.0.0.1", 0), Health) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        os.environ["MODELOPS_PREFECT_PORT"] = str(port)
        prefect_api.prefect_target()  # something listens, but it is no Prefect server: the profile's server
        assert os.environ["PREFECT_API_URL"] == "http://t:1/api"
        del os.environ["PREFECT_API_URL"]
        healthy.set()  # the local stack's Prefect server answers
        prefect_api.prefect_target()
        stack = f"http://127.0.0.1:{port}/api"
        assert os.environ["PREFECT_API_URL"] == stack
        note = capsys.readouterr().err
        assert f"using the local stack's Prefect server {stack}, not http://t:1/api from " in note
        assert "(profile t); set PREFECT_API_URL to choose" in note
        os.environ["PREFECT_API_URL"] = "http://env:2/api"  # the environment wins over everything
        prefect_api.prefect_target()
        assert os.environ["PREFECT_API_URL"] == "http://env:2/api"
        server.shutdown()


def test_the_cli_sends_the_stacks_prefect_auth_string_to_its_server_only(prefect_clean: Path):
    from modelops.settings import get_settings
    from modelops_cli.local_stack import prefect_auth_string, prefect_env

    os.environ.update(MODELOPS_HOME=str(prefect_clean / "home"), MODELOPS_PREFECT_PORT="4555")
    stack = os.environ["PREFECT_API_URL"] = "http://127.0.0.1:4555/api/"
    prefect_api.prefect_target()
    assert "PREFECT_API_AUTH_STRING" not in os.environ  # a stack never started has none, and none is made
    auth = prefect_auth_string(get_settings())  # what `up` makes, once
    assert auth == prefect_auth_string(get_settings()) and re.fullmatch(r"modelops:[A-Za-z0-9_-]{43}", auth)
    assert get_settings().prefect_auth_file.stat().st_mode & 0o777 == 0o600
    env = prefect_env(get_settings())  # the server requires it; the worker and the flow runs send it
    assert env["PREFECT_SERVER_API_AUTH_STRING"] == env["PREFECT_API_AUTH_STRING"] == auth
    prefect_api.prefect_target()
    assert os.environ["PREFECT_API_AUTH_STRING"] == auth
    del os.environ["PREFECT_API_AUTH_STRING"]
    os.environ["PREFECT_API_URL"] = "http://127.0.0.1:4556/api"  # another server gets nothing of ours
    prefect_api.prefect_target()
    assert "PREFECT_API_AUTH_STRING" not in os.environ
    os.environ.update(PREFECT_API_URL=stack, PREFECT_API_AUTH_STRING="mine")  # the environment's own wins
    prefect_api.prefect_target()
    assert os.environ["PREFECT_API_AUTH_STRING"] == "mine"


def test_a_prefect_server_that_refuses_the_clis_credentials_is_one_error_naming_the_fix(prefect_clean: Path,
                                                                                       capsys):
    """Prefect's /health answers without credentials: the CLI also asks /admin/version, which a
    server with an auth string answers 401 unless given it (prefect/server/api/server.py)."""
    import base64
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import typer

    good = "Basic " + base64.b64encode(b"modelops:right").decode()

    class Server(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/api/health" or self.headers.get("Authorization") == good
            self.send_response(200 if ok else 401)
            self.end_headers()

        def log_message(self, *args):
            pass

    os.environ["MODELOPS_HOME"] = str(prefect_clean / "home")
    with ThreadingHTTPServer(("127.0.0.1", 0), Server) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{server.server_address[1]}/api"
        for auth in (None, "modelops:wrong"):
            if auth:
                os.environ["PREFECT_API_AUTH_STRING"] = auth
            with pytest.raises(typer.Exit):
                prefect_api.require_prefect()
            said = " ".join(capsys.readouterr().err.split())
            assert "refused this CLI's credentials (401): set PREFECT_API_AUTH_STRING" in said, said
            assert str(prefect_clean / "home" / "run" / "prefect.auth") in said
        os.environ["PREFECT_API_AUTH_STRING"] = "modelops:right"
        prefect_api.require_prefect()  # taken: no exit
        server.shutdown()


def test_errors_under_json_are_one_json_document_on_stdout(home: Path):
    out = subprocess.run([CLI, "rollback", "no-such-model", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    doc = json.loads(out.stdout)
    assert doc["exit_code"] == 2 and "no-such-model" in doc["error"]
    assert out.stderr.startswith("error: ") and "no-such-model" in out.stderr  # humans still read stderr
    plain = subprocess.run([CLI, "rollback", "no-such-model"], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and plain.stdout == ""


def test_the_crash_automation_is_a_valid_prefect_automation():
    from datetime import timedelta

    from prefect.events.schemas.automations import AutomationCore, Posture

    from modelops_cli.local_stack import AUTOMATIONS_DIR

    automation = AutomationCore.model_validate_json((AUTOMATIONS_DIR / "crash-silent-flow-runs.json").read_text())
    trigger = automation.trigger
    assert (trigger.posture, trigger.within, trigger.for_each) == (Posture.Proactive, timedelta(seconds=90),
                                                                  {"prefect.resource.id"})
    # two heartbeats may be missed before a run is crashed: a live run under load is never crashed
    import yaml

    from modelops.settings import REPO_ROOT

    env = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["definitions"]["work_pool"]["job_variables"]["env"]
    assert trigger.within > timedelta(seconds=2 * int(env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]))
    assert automation.actions[0].type == "change-flow-run-state" and automation.actions[0].state.value == "CRASHED"


def test_flow_run_processes_are_found_by_their_stack_home(tmp_path: Path):
    from modelops.settings import Settings
    from modelops_cli.local_stack import flow_run_processes

    def fake_run(home: Path) -> subprocess.Popen:  # a process whose command line names prefect.engine
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "prefect.engine"],
                                env={**os.environ, "MODELOPS_HOME": str(home)}, start_new_session=True)

    ours, theirs = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    try:
        assert flow_run_processes(Settings(home=tmp_path / "a")) == [ours.pid]
        assert flow_run_processes(Settings(home=tmp_path / "c")) == []
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()
    assert flow_run_processes(Settings(home=tmp_path / "a")) == []


def test_an_unreachable_configured_server_is_named_with_its_source(home: Path):
    manifest = str(Path(__file__).resolve().parents[2] / "deployments/models/all-minilm-l6-v2.yaml")
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:1/api"}
    out = subprocess.run([CLI, "announce", manifest, "--local", "--json"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert json.loads(out.stdout)["error"] == (
        "Prefect API at http://127.0.0.1:1/api is not reachable (the URL comes from PREFECT_API_URL in the "
        "environment): fix or unset it there; a --local run records its flow run on that server too")
    bad = subprocess.run([CLI, "announce", manifest], env={**env, "PREFECT_API_URL": "not-a-url",
                                                           "MODELOPS_FAIL_STAGE": "verify"},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "Prefect API at not-a-url is not a valid URL" in bad.stderr
    assert "warning: MODELOPS_FAIL_STAGE is ignored here" in bad.stderr


def test_a_stack_up_on_another_prefect_port_is_named_instead_of_modelops_up(home: Path):
    import signal
    import sys

    from tests.conftest import free_port

    # A process standing in for this home's Prefect server, started with another --port.
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--port", str(port)])
    try:
        (home / "run").mkdir(parents=True)
        (home / "run" / "prefect-server.pid").write_text(str(server.pid))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        manifest = str(Path(__file__).resolve().parents[2] / "deployments/models/all-minilm-l6-v2.yaml")
        out = subprocess.run([CLI, "announce", manifest], env={**env, "MODELOPS_PREFECT_PORT": str(free_port())},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and f"set MODELOPS_PREFECT_PORT={port}" in out.stderr, out.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=10)


def test_an_announcement_too_large_for_one_event_is_refused_before_emitting(home: Path, tmp_path: Path):
    """20,000 made-up engine args: a one-line error and exit 2 (was a raw EventTooLarge traceback);
    a manifest of valid args but over Prefect's event size: refused with both sizes."""
    import yaml

    from modelops import ManifestError, parse_manifest
    from modelops_cli.models import _check_event_size

    many = tmp_path / "many.yaml"
    many.write_text(yaml.safe_dump({"model_id": "big", "version": "1", "source": "s3://models/big/1/",
                                    "task": "generate",  # ~2 MB: over the event size too, where no image is built
                                    "engine_args": {f"bogus_{i}": "v" * 80 for i in range(20000)}}))
    out = subprocess.run([CLI, "announce", str(many)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.startswith("error: ") and len(out.stderr.splitlines()) <= 13, out.stderr[-2000:]
    huge = parse_manifest({"model_id": "big", "version": "1", "source": "s3://models/big/1/", "task": "generate",
                           "engine_args": {"hf_overrides": {"x": "y" * 1_600_000}}})
    with pytest.raises(ManifestError, match=r"about 1,60\d,\d{3} bytes; the Prefect server accepts at most 1,500,000"):
        _check_event_size(huge)
    _check_event_size(parse_manifest({**huge.model_dump(), "engine_args": {}}))


def test_a_table_is_as_wide_as_columns_and_one_too_wide_is_printed_as_blocks_never_cut(monkeypatch, capsys):
    from rich.table import Table

    from modelops_cli.output import print_table

    def table() -> Table:
        t = Table("model", "instance", "OpenAI", "reason")
        t.add_row("all-minilm-l6-v2", "all-minilm-l6-v2-2-1\nrestarted 2x, last: exit 70",
                  "http://127.0.0.1:40123/v1", "replaced by 3 (red-black): the I/O schema equals the serving version")
        t.add_row("m", "m-1-1", "http://127.0.0.1:1/v1", "")
        return t

    monkeypatch.setenv("COLUMNS", "60")
    print_table(table())
    blocks = capsys.readouterr().out.split("\n\n")
    assert blocks[0].splitlines() == [
        "model: all-minilm-l6-v2", "instance: all-minilm-l6-v2-2-1", "          restarted 2x, last: exit 70",
        "OpenAI: http://127.0.0.1:40123/v1",
        "reason: replaced by 3 (red-black): the I/O schema equals the serving version"]
    assert blocks[1].splitlines() == ["model: m", "instance: m-1-1", "OpenAI: http://127.0.0.1:1/v1"]  # no empty cell
    for columns in ("200", None):  # wide enough; piped without COLUMNS: 240
        if columns:
            monkeypatch.setenv("COLUMNS", columns)
        else:
            monkeypatch.delenv("COLUMNS")
        print_table(table())
        out = capsys.readouterr().out
        assert out.startswith("┏") and "…" not in out and max(map(len, out.splitlines())) <= int(columns or 240)
        assert "http://127.0.0.1:40123/v1" in out and "the I/O schema equals the serving version" in out


def test_every_command_help_keeps_each_prose_paragraph_on_one_line():
    import click
    import typer.main

    from modelops_cli.main import app

    def commands(group: click.Group, path: str):
        for name, command in group.commands.items():
            yield f"{path} {name}", command
            if isinstance(command, click.Group):
                yield from commands(command, f"{path} {name}")

    found = list(commands(typer.main.get_command(app), "modelops"))
    assert len(found) > 10 and any(path == "modelops announce" for path, _ in found)
    for path, command in found:
        for paragraph in (command.help or "").split("\n\n"):
            listed = any(line.lstrip().startswith(("-", "*")) for line in paragraph.splitlines())
            assert listed or paragraph.startswith("\b") or "\n" not in paragraph, (path, paragraph)


def test_announce_wait_says_each_stage_once_as_it_starts_and_ends():
    from datetime import datetime, timedelta, timezone
    from types import SimpleNamespace

    from prefect.states import Completed, Failed, Pending, Running

    from modelops_cli.prefect_api import StageLog

    t0 = datetime(2026, 12, 5, tzinfo=timezone.utc)

    def run(id_, name, state, start, seconds=0.0, task_key=None):
        return SimpleNamespace(id=id_, name=name, state=state, start_time=t0 + timedelta(seconds=start),
                               expected_start_time=None, created=t0, total_run_time=timedelta(seconds=seconds),
                               task_key=task_key or f"flows.lifecycle.{name}")

    log = StageLog()
    assert log.lines([run(1, "validate-0", Running(), 0), run(2, "materialize-0", Pending(), 1)]) == \
        ["  validate: running"]
    assert log.lines([run(2, "materialize-0", Running(), 1), run(1, "validate-0", Completed(), 0, 0.4)]) == \
        ["  validate: completed in 0 s", "  materialize: running"]
    assert log.lines([run(1, "validate-0", Completed(), 0, 0.4), run(2, "materialize-0", Running(), 1)]) == []
    failed = Failed(message="provision failed:\n  the model did not load")
    assert log.lines([run(2, "materialize-0", Completed(), 1, 12.6), run(3, "provision-0", failed, 14)]) == \
        ["  materialize: completed in 13 s", "  provision: failed: provision failed: the model did not load"]
    # A global rollout's child runs: said by the region_run task that started each, not by Prefect's stand-in.
    child = run(4, "model-lifecycle/region-2", Running(), 20,
                task_key="prefect.deployments.flow_runs.run_deployment.model-lifecycle-region-2")
    assert log.lines([child, run(5, "region-2: model-lifecycle", Running(), 20)]) == \
        ["  region-2: model-lifecycle: running"]


def test_the_status_scaling_column_says_the_policy_and_the_latest_decision():
    from modelops_cli.models import scaling_text

    assert scaling_text(None, None) == "-"
    assert scaling_text({"min": 2, "max": 2}, None) == "2 fixed"
    assert scaling_text({"min": 1, "max": 3, "target": {"waiting": 2}}, None) == "1..3 on waiting 2"
    assert scaling_text({"min": 0, "max": 1}, None) == "0..1, zero when idle"
    last = {"before": 0, "after": 1, "outcome": "failed", "seconds": 61.2, "detail": "instance x exited"}
    assert scaling_text({"min": 0, "max": 1}, last) == "0..1, zero when idle\nlast: 0→1 failed (61 s): instance x exited"


@pytest.mark.parametrize("content", [b"not a database at all", b"\x00" * 4096, b"SQLite format 2\x00" + b"x" * 100])
def test_a_registry_file_that_is_no_database_is_one_line_from_every_command_that_opens_it(home: Path, content):
    """An overwritten registry.db was a SQLAlchemy traceback ("file is not a database"); each command
    that opens the registry now says which file and the way out, exit 2 (under --json as JSON too),
    and leaves the file as it was."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "registry.db").write_bytes(content)
    for args in (["status"], ["keys", "ls", "--json"]):
        out = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert f"the registry {home / 'registry.db'} is not a SQLite database" in out.stderr, out.stderr
        assert "restore it from a backup, or move it away" in out.stderr
    assert json.loads(out.stdout)["exit_code"] == 2
    assert (home / "registry.db").read_bytes() == content


def test_a_registry_damaged_past_its_first_pages_is_one_line_when_a_command_meets_it(home: Path):
    """A real registry whose later pages were overwritten opens, then fails at the first query
    (SQLite: "database disk image is malformed"): that is one line and exit 2 too."""
    import random

    assert subprocess.run([CLI, "status"], capture_output=True, timeout=120).returncode == 0  # makes the registry
    db = home / "registry.db"
    data = bytearray(db.read_bytes())
    noise = random.Random(0)
    data[8192:8192 + 40960] = bytes(noise.randrange(256) for _ in range(40960))
    db.write_bytes(bytes(data))
    out = subprocess.run([CLI, "status"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip() == (f"error: the registry {db} failed: database disk image is malformed: restore it "
                                  "from a backup, or move it away and modelops starts an empty one (every model, "
                                  "version and key it held is then forgotten)"), out.stderr
