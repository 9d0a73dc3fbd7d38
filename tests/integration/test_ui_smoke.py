"""The Prefect UI, rendered in headless Chromium, shows a flow run's artifacts and its report.

A tiny flow run on the session's Prefect server creates the three artifact kinds the rollout
flow creates (a markdown report, a table, a progress bar, keyed as tasks/observe.py keys them).
Prefect 3.9.1 serves two UIs: V2 (React, the default: ``/`` redirects to ``/v2/``) and V1 (Vue,
still served at the unprefixed deep links such as the ``/runs/flow-run/<id>`` that flow logs
print). On both, a flow run's Artifacts tab shows one card per artifact (type, key, description),
never the content; the markdown is rendered on the artifact's own page, which a click on its card
opens. Screenshots go to bench/results/.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.integration.browser import render_page
from tests.integration.conftest import REPO, Stack

pytestmark = pytest.mark.e2e

RESULTS = REPO / "bench" / "results"
MODEL = "ui-smoke-model"  # keys of their own: the session's stack also runs the real demo model
KEYS = [f"rollout-{MODEL}", f"versions-{MODEL}", f"traffic-{MODEL}"]  # as tasks/observe.py names them
REPORT_TEXT = [
    f"Rollout report: {MODEL} v2",
    "materialize 12.3 s",  # a table row: cells are tab-separated in innerText, compared as one space
    "strategy red-black because the new version changes the tokenizer",
    "Final weights: v1 0%, v2 100%",
]

FLOW = f'''
import json
from prefect import flow
from prefect.artifacts import (create_markdown_artifact, create_progress_artifact,
                               create_table_artifact, update_progress_artifact)
from prefect.runtime import flow_run

REPORT = """# Rollout report: {MODEL} v2

| stage | duration |
|---|---|
| materialize | 12.3 s |
| canary 10% | 30.0 s |
| promote 100% | 5.1 s |

strategy red-black because the new version changes the tokenizer

Final weights: v1 0%, v2 100%
"""


@flow(name="ui-smoke")
def ui_smoke():
    progress = create_progress_artifact(0.0, key="traffic-{MODEL}", description="traffic to {MODEL} v2 (percent)")
    table = create_table_artifact([{{"version": "v1", "weight": 0}}, {{"version": "v2", "weight": 100}}],
                                  key="versions-{MODEL}", description="versions of {MODEL}")
    update_progress_artifact(progress, 50.0)
    report = create_markdown_artifact(REPORT, key="rollout-{MODEL}", description="rollout report")
    update_progress_artifact(progress, 100.0)
    return {{"flow_run_id": str(flow_run.id), "flow_run_name": flow_run.name,
             "artifacts": {{"progress": str(progress), "table": str(table), "report": str(report)}}}}


print("RESULT " + json.dumps(ui_smoke()))
'''


@pytest.fixture(scope="module")
def flow_run(stack: Stack, tmp_path_factory) -> dict:
    """A completed flow run with the three artifacts, on the session stack's Prefect server."""
    work = tmp_path_factory.mktemp("ui-smoke")
    (work / "flow.py").write_text(FLOW)
    env = {**stack.env, **stack.prefect_api_env, "PREFECT_HOME": str(work / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    proc = subprocess.run([sys.executable, str(work / "flow.py")], check=False, env=env, cwd=work, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "ui": f"http://127.0.0.1:{stack.env['MODELOPS_PREFECT_PORT']}",
            "sign_in": stack.ui_sign_in}


# V2 opens the tab from the query string; V1 reads ?tab= too but drops it while the run loads
# (the tab is hidden until then), so the tab is clicked.
PAGES = {
    "v2": ("/v2/runs/flow-run/{id}?tab=Artifacts", []),
    "v1": ("/runs/flow-run/{id}", ["Artifacts"]),
}


@pytest.mark.parametrize("ui", ["v2", "v1"])
def test_flow_run_page_shows_artifacts_and_report(flow_run: dict, ui: str) -> None:
    path, clicks = PAGES[ui]
    url = flow_run["ui"] + path.format(id=flow_run["flow_run_id"])
    suffix = "" if ui == "v2" else "-v1"

    t0 = time.monotonic()
    text = render_page(url, wait_for=[flow_run["flow_run_name"], *KEYS],
                       screenshot=RESULTS / f"ui-smoke-flow-run{suffix}.png", click_text=clicks, timeout_s=60,
                       local_storage=flow_run["sign_in"])
    cards_s = time.monotonic() - t0
    for key in KEYS:
        assert key in text

    # The cards carry no content: the report is on the markdown artifact's page, one click away.
    t0 = time.monotonic()
    text = render_page(url, wait_for=[f"rollout-{MODEL}", flow_run["artifacts"]["report"], *REPORT_TEXT],
                       screenshot=RESULTS / f"ui-smoke-rollout-report{suffix}.png",
                       click_text=[*clicks, f"rollout-{MODEL}"], timeout_s=60, local_storage=flow_run["sign_in"])
    report_s = time.monotonic() - t0
    assert "markdown" in text  # the page's "Type" field
    print(f"\nUI {ui}: artifact cards rendered in {cards_s:.1f} s, report page in {report_s:.1f} s "
          "(Chromium start included)")


def test_ui_without_the_auth_string_shows_its_sign_in_and_no_run(flow_run: dict, tmp_path) -> None:
    """The stack's Prefect server requires its auth string (modelops_cli/local_stack.py), so the
    UI asks for it (V2's "Login" page, its field hinting the ``user:password`` form) and shows no
    run; a wrong string is not taken."""
    import base64

    url = flow_run["ui"] + PAGES["v2"][0].format(id=flow_run["flow_run_id"])
    for stored in (None, {"prefect-password": base64.b64encode(b"modelops:wrong").decode()}):
        text = render_page(url, wait_for=["Login"], screenshot=tmp_path / "sign-in.png", timeout_s=60,
                           local_storage=stored)
        assert flow_run["flow_run_name"] not in text and f"rollout-{MODEL}" not in text
