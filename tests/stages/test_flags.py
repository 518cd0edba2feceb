"""Flags are booleans or the words true/false; anything else is a configuration error."""

import pytest
from pydantic import BaseModel, ValidationError

from kvpipe.stages import ConfigError, StrictFlag, parse_flag


@pytest.mark.parametrize("value", [False, "false", "False", " FALSE\n"])
def test_off_values(value):
    assert parse_flag(value, "enable_group_semantics") is False


@pytest.mark.parametrize("value", [True, "true", " TRUE "])
def test_on_values(value):
    assert parse_flag(value, "enable_group_semantics") is True


@pytest.mark.parametrize("value", ["flase", 1.5, "yes please", 1, 0, None, ""])
def test_anything_else_is_a_configuration_error_naming_field_and_value(value):
    with pytest.raises(ConfigError) as raised:
        parse_flag(value, "enable_group_semantics")

    assert str(raised.value) == f"enable_group_semantics: expected true or false, got {value!r}"


def test_configuration_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


class _Params(BaseModel):
    enable_group_semantics: StrictFlag = False


@pytest.mark.parametrize(("value", "expected"), [("true", True), (" False ", False), (True, True)])
def test_strict_flag_field_parses_like_parse_flag(value, expected):
    assert _Params(enable_group_semantics=value).enable_group_semantics is expected


def test_strict_flag_field_rejects_a_typo_with_the_field_name():
    with pytest.raises(ValidationError) as raised:
        _Params(enable_group_semantics="flase")

    error = raised.value.errors()[0]
    assert error["loc"] == ("enable_group_semantics",)
    assert "enable_group_semantics: expected true or false, got 'flase'" in error["msg"]
