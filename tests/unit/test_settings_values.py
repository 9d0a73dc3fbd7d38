"""modelops/settings.py: values no setting can mean are refused, naming the variable."""

import typing

import pytest
from pydantic import ValidationError

from modelops.settings import Settings, settings_problem

FLOATS = sorted(name for name, field in Settings.model_fields.items()
                if float in (field.annotation, *typing.get_args(field.annotation)))


def test_there_are_float_settings_to_check():
    assert {"batch_stale_after_s", "batch_quiet_s", "drain_timeout_s"} <= set(FLOATS)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
@pytest.mark.parametrize("name", FLOATS)
def test_no_float_setting_takes_inf_or_nan(home, monkeypatch, name, value):
    """inf seconds overflow a wait (threading.Event.wait raises OverflowError), and nan passed
    every bound with a message that named the wrong one."""
    monkeypatch.setenv(f"MODELOPS_{name.upper()}", value)
    with pytest.raises(ValidationError) as refused:
        Settings()
    said = settings_problem(refused.value)
    assert said == f"MODELOPS_{name.upper()}: Input should be a finite number (got {value!r})", said


@pytest.mark.parametrize("name, ok", [
    ("modelops-batches", True), ("team.batches-2", True), ("123", True),
    ("Team-Batches", False), ("team_batches", False), ("-batches", False), ("batches-", False), ("a..b", False),
    ("batches/", False), ("s3://batches", False), ("192.168.5.4", False), ("xn--batches", False),
    ("sthree-batches", False), ("batches-s3alias", False), ("batches--ol-s3", False), ("batches.mrap", False),
])
def test_the_batch_bucket_is_an_s3_bucket_name(home, monkeypatch, name, ok):
    """S3's naming rules, checked when settings load: boto's error came only at the first upload."""
    monkeypatch.setenv("MODELOPS_BATCH_BUCKET", name)
    if ok:
        assert Settings().batch_bucket == name
        return
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert settings_problem(refused.value).startswith("MODELOPS_BATCH_BUCKET: Value error, not an S3 bucket name")


@pytest.mark.parametrize("url, says", [
    ("http://gw/v1 ", "not an http:// or https:// URL"), ("http://gw:99999/v1", "not an http:// or https:// URL"),
    ("gw/v1", "not an http:// or https:// URL"), ("http://u:p@gw/v1", "has a user or password in it"),
])
def test_the_gateway_url_is_an_http_url_without_credentials(home, monkeypatch, url, says):
    monkeypatch.setenv("MODELOPS_K8S_GATEWAY_URL", url)
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert settings_problem(refused.value).startswith(f"MODELOPS_K8S_GATEWAY_URL: Value error, {says}")


def test_an_empty_gateway_url_is_unset(home, monkeypatch):
    monkeypatch.setenv("MODELOPS_K8S_GATEWAY_URL", "")  # `export VAR=` to clear it
    assert Settings().k8s_gateway_url is None
    monkeypatch.setenv("MODELOPS_K8S_GATEWAY_URL", "https://gw.example:8443/v1")
    assert Settings().k8s_gateway_url == "https://gw.example:8443/v1"
