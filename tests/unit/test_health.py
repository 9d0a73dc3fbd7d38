"""The router-side checks of tasks/health.py (the real HAProxy, stand-in instances of versions 1
and 2 of model m): a route check passes only when the version named answers, unpinned or pinned
as asked, and says what it saw when it does not; a gate's probe requests are pinned and spread
by session key. (An instance's own KServe/OpenAI checks run against real engines in the
integration tests.)"""

from __future__ import annotations

import pytest

from modelops.errors import HealthCheckError

pytestmark = pytest.mark.skipif(not __import__("shutil").which("haproxy"), reason="haproxy is not installed")


def test_the_route_check_passes_only_for_the_version_that_answers(two_versions):
    from tasks.health import verify_route

    assert verify_route("m", "1", "embed", default=True) == "unpinned request through the router answered by 1"
    assert verify_route("m", "2", "embed", default=False) == "pinned request through the router answered by 2"
    with pytest.raises(HealthCheckError, match=r"an unpinned request for m did not reach version 2 \(status 200, "
                                               r"answered by version '1'"):
        verify_route("m", "2", "embed", default=True, attempts=1)
    with pytest.raises(HealthCheckError, match="a pinned request for m did not reach version 7 .*status 404"):
        verify_route("m", "7", "embed", default=False, attempts=1)


def test_a_gates_probe_is_pinned_and_reports_each_failure(two_versions):
    from tasks.health import probe_version

    assert probe_version("m", "2", "embed", kserve=False, count=4) == []
    assert [t for t in two_versions[3]["2"].answered] == [f"modelops gate probe {i}" for i in range(4)]
    assert two_versions[3]["1"].answered == []
    problems = probe_version("m", "7", "embed", kserve=False, count=2)
    assert len(problems) == 2 and all(p.startswith("status 404") for p in problems)
