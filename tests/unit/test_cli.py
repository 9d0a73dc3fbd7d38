"""The CLI's scripting surface: which Prefect server it talks to, and errors under --json."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from modelops import cli
from modelops.stack import configured_prefect_api_url

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


def test_configured_server_follows_prefects_precedence(prefect_clean: Path):
    work = prefect_clean / "work"
    assert configured_prefect_api_url() is None  # no profile file at all
    (prefect_clean / "profiles.toml").write_text(
        'active = "team"\n[profiles.team]\nPREFECT_API_URL = "http://prefect.team:4200/api"\n'
        '[profiles.other]\nPREFECT_API_URL = "http://other:4200/api"\n[profiles.bare]\n')
    assert configured_prefect_api_url() == ("http://prefect.team:4200/api",
                                            f"{prefect_clean / 'profiles.toml'} (profile team)")
    os.environ["PREFECT_PROFILE"] = "other"  # the variable picks the profile, as in Prefect
    assert configured_prefect_api_url()[0] == "http://other:4200/api"
    os.environ["PREFECT_PROFILE"] = "bare"  # an active profile without a URL configures nothing
    assert configured_prefect_api_url() is None
    (work / "prefect.toml").write_text('[api]\nurl = "http://project:4200/api"\n')
    assert configured_prefect_api_url() == ("http://project:4200/api", str(work / "prefect.toml"))
    (work / ".env").write_text("# comment\nexport PREFECT_API_URL='http://dotenv:4200/api'\n")
    assert configured_prefect_api_url() == ("http://dotenv:4200/api", str(work / ".env"))
    (work / ".env").write_text("OTHER=1\n")
    (work / "prefect.toml").write_text("[api\n")  # malformed: skipped, Prefect itself reports it
    assert configured_prefect_api_url() is None


def test_a_configured_server_wins_over_the_local_stack(prefect_clean: Path):
    with socket.socket() as listener:  # the local stack's Prefect port answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        os.environ["MODELOPS_PREFECT_PORT"] = str(listener.getsockname()[1])
        os.environ["MODELOPS_HOME"] = str(prefect_clean / "home")
        cli._prefect_target()
        assert os.environ["PREFECT_API_URL"] == f"http://127.0.0.1:{listener.getsockname()[1]}/api"

        del os.environ["PREFECT_API_URL"]
        (prefect_clean / "profiles.toml").write_text('active = "t"\n[profiles.t]\nPREFECT_API_URL = "http://t:1/api"\n')
        cli._prefect_target()
        assert os.environ["PREFECT_API_URL"] == "http://t:1/api"

        os.environ["PREFECT_API_URL"] = "http://env:2/api"  # the environment wins over everything
        cli._prefect_target()
        assert os.environ["PREFECT_API_URL"] == "http://env:2/api"


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

    from modelops.stack import AUTOMATIONS_DIR

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
