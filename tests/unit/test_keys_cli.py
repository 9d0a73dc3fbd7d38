"""``modelops keys``: keys shown once and stored hashed, bad input refused before anything is
written, and each change reaching a running router (real HAProxy) at once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from modelops import get_settings
from modelops.registry import Registry
from modelops.tenancy import check_grant, key_hash

CLI = str(Path(sys.executable).parent / "modelops")


def _keys(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([CLI, "keys", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_check_grant_names_the_field_and_the_fix():
    assert check_grant("team-a", ["a", " b ", "a"], rpm=1, tpm=2**31 - 1) == ("a", "b")
    for args, field in (((" Team", ["a"]), "--name"), (("-a", ["a"]), "--name"), (("a" * 64, ["a"]), "--name"),
                        (("t", []), "--models"), (("t", ["*", "a"]), "--models"), (("t", ["A_b"]), "--models"),
                        (("t", ["a"], 0), "--rpm"), (("t", ["a"], None, -1), "--max-concurrency"),
                        (("t", ["a", ""]), "--models"), (("t", ["a"], None, None, 2**31), "--tpm"),
                        (("modelops", ["a"]), "--name")):
        with pytest.raises(ValueError) as refused:
            check_grant(*args)
        assert str(refused.value).startswith(field), refused.value


def test_a_key_is_printed_once_and_stored_only_as_its_hash(home: Path):
    made = _keys("create", "--name", "team-a", "--models", "smol,all-minilm-l6-v2", "--rpm", "60")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("mo-") and len(key) == 46 and "only time" in made.stderr
    (row,) = Registry(get_settings().registry).api_keys()
    assert row.key_hash == key_hash(key) and row.models == ("smol", "all-minilm-l6-v2") and row.rpm == 60
    stored = b"".join(p.read_bytes() for p in home.rglob("*") if p.is_file())
    assert key.encode() not in stored  # not in the registry, not in any log or map
    listed = _keys("ls", "--json")
    assert key not in listed.stdout and json.loads(listed.stdout)[0]["state"] == "active"

    rotated = _keys("rotate", "team-a", "--json")
    new = json.loads(rotated.stdout)["key"]
    assert new != key and Registry(get_settings().registry).api_keys()[0].key_hash == key_hash(new)
    assert _keys("revoke", "team-a").returncode == 0
    assert json.loads(_keys("ls", "--json").stdout)[0]["state"] == "revoked"
    again = _keys("rotate", "team-a")
    assert again.returncode == 2 and "revoked; create a new one under another name" in again.stderr
    # and create does not send the user back to rotate
    reused = _keys("create", "--name", "team-a", "--models", "a")
    assert reused.returncode == 2 and "belongs to a revoked key" in reused.stderr and "rotate" not in reused.stderr


def test_bad_input_is_refused_before_anything_is_written(home: Path):
    assert _keys("create", "--name", "team-a", "--models", "a").returncode == 0
    for args, says in ((("create", "--name", "team-a", "--models", "a"), "exists already"),
                       (("create", "--name", "Team A", "--models", "a"), "--name"),
                       (("create", "--name", "t", "--models", ","), "--models"),
                       (("create", "--name", "t", "--models", "a", "--max-concurrency", "0"), "--max-concurrency"),
                       (("create", "--name", "t", "--models", "a,,b"), "an entry is empty"),
                       (("create", "--name", "t", "--models", "a", "--rpm", str(2**63)), "--rpm"),
                       (("create", "--name", "modelops", "--models", "a"), "reserved"),
                       (("usage", "nobody"), "no key named"), (("usage", "--minutes", "inf"), "--minutes"),
                       (("revoke", "nobody"), "no key named"), (("rotate", "nobody"), "no key named")):
        refused = _keys(*args)
        assert refused.returncode == 2 and says in refused.stderr, (args, refused.stderr)
    # On Kubernetes the key goes into the Gateway's Secret first: no cluster, nothing stored.
    gateway = {"MODELOPS_ROUTER": "gateway-api", "MODELOPS_K8S_KUBECONFIG": str(home / "no-kubeconfig")}
    refused = _keys("create", "--name", "t", "--models", "a", env=gateway)
    assert refused.returncode == 1 and "could not store key 't', so nothing was stored" in refused.stderr
    assert "cannot load Kubernetes credentials" in refused.stderr
    # Envoy Gateway has no per-client concurrency limit: refused before the cluster is asked.
    refused = _keys("create", "--name", "t", "--models", "a", "--max-concurrency", "2", env=gateway)
    assert refused.returncode == 2 and "--max-concurrency: the gateway-api router cannot enforce" in refused.stderr
    assert [k.name for k in Registry(get_settings().registry).api_keys()] == ["team-a"]


@pytest.mark.skipif(not shutil.which("haproxy"), reason="haproxy is not installed (make haproxy)")
def test_each_change_reaches_a_running_router_at_once(home: Path):
    from tasks.traffic.haproxy import HAProxyRouter

    router = HAProxyRouter(get_settings())
    router.apply([])
    try:
        url = f"{get_settings().router_url}/models"
        assert httpx.get(url, timeout=5).status_code == 200  # no key yet: open
        made = _keys("create", "--name", "team-a", "--models", "*")
        assert "the router checks it now" in made.stderr
        key = made.stdout.strip()
        assert httpx.get(url, timeout=5).status_code == 401
        assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=5).status_code == 200
        _keys("revoke", "team-a")
        assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=5).status_code == 401
    finally:
        router.stop()
