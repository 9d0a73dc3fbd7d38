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
