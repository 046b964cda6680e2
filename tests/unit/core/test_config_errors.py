"""Bad configuration a user can type: each is one ConfigError line naming the variable,
file or field, never a secret, and the fix (unit: load_settings; CLI: exit code and
stderr before any worker starts)."""
from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.core.config import check_environment, load_settings
from elastictrain.core.errors import ConfigError

SECRET = "s3cr3t-planted-value"
def _error(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as raised:
        load_settings()
    return str(raised.value)


@pytest.mark.parametrize(("name", "suggestion"), [
    ("ELASTICTRAIN_SNAPSHOTS__KEEP", "ELASTICTRAIN_SNAPSHOT__KEEP"),
    ("ELASTICTRAIN_SNAPSHOT__EVERY", "ELASTICTRAIN_SNAPSHOT__EVERY_STEPS"),
    ("ELASTICTRAIN_WATCHDOG__TIMEOUT", "ELASTICTRAIN_WATCHDOG__TIMEOUT_S"),
    ("ELASTICTRAIN_STORAGE__FAULTS__LATENCY", "ELASTICTRAIN_STORAGE__FAULTS__LATENCY_S"),
    ("ELASTICTRAIN_CONFG", "ELASTICTRAIN_CONFIG")])
def test_misspelt_environment_name_names_the_closest(monkeypatch: pytest.MonkeyPatch,
                                                     name: str, suggestion: str) -> None:
    message = _error(monkeypatch, **{name: SECRET})
    assert f"unknown setting {name} in the environment; did you mean {suggestion}?" in message
    assert SECRET not in message and "fix:" in message


def test_valid_environment_names_pass() -> None:
    check_environment({"ELASTICTRAIN_SNAPSHOT__KEEP": "5", "ELASTICTRAIN_RUN_ID": "x",
                       "ELASTICTRAIN_CONFIG": "a.toml", "ELASTICTRAIN_SNAPSHOT": '{"keep": 4}',
                       "ELASTICTRAIN_STORAGE__STORAGE_OPTIONS__ANON": "true",
                       "ELASTICTRAIN_PREEMPT__SIGNALS": '["SIGUSR2"]'})


def test_a_field_of_an_optional_section_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """storage.faults is ``FaultsConfig | None``: its fields are set one by one too, as
    its docstring says (the check refused them before)."""
    monkeypatch.setenv("ELASTICTRAIN_STORAGE__FAULTS__LATENCY_S", "0.25")
    faults = load_settings().storage.faults
    assert faults is not None and faults.latency_s == 0.25


def test_lower_case_names_still_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("elastictrain_snapshot__keep", "7")
    assert load_settings().snapshot.keep == 7


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("ELASTICTRAIN_STORAGE__STORAGE_OPTIONS", "{" + SECRET, "is not JSON"),
    ("ELASTICTRAIN_STORAGE__STORAGE_OPTIONS", f'["{SECRET}"]', "must be a JSON object"),
    ("ELASTICTRAIN_PREEMPT__SIGNALS", "SIGTERM", "is not JSON"),
    ("ELASTICTRAIN_SNAPSHOT", "keep=4", "is not JSON")])
def test_structured_values_must_be_json(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                        expected: str) -> None:
    message = _error(monkeypatch, **{name: value})
    assert message.startswith(f"{name} {expected}") and "fix: a JSON" in message
    assert SECRET not in message


def test_config_variable_naming_a_missing_file(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    message = _error(monkeypatch, ELASTICTRAIN_CONFIG=str(missing))
    assert message == (f"ELASTICTRAIN_CONFIG={str(missing)!r} does not exist; fix: name an "
                       "existing TOML file or unset ELASTICTRAIN_CONFIG")
    assert "is a directory" in _error(monkeypatch, ELASTICTRAIN_CONFIG=str(tmp_path))


def test_toml_syntax_error_names_file_and_line(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    toml = tmp_path / "et.toml"
    toml.write_text("[snapshot]\nkeep = \n")
    message = _error(monkeypatch, ELASTICTRAIN_CONFIG=str(toml))
    assert message.startswith(f"config file {toml}: TOML syntax error: ")
    assert "line 2" in message and "fix:" in message


@pytest.mark.parametrize(("text", "expected"), [
    ("[snapshots]\nkeep = 5\n", "unknown setting snapshots; did you mean snapshot?"),
    ("[snapshot]\nkep = 5\n", "unknown setting snapshot.kep; did you mean snapshot.keep?")])
def test_unknown_toml_keys_name_the_closest(tmp_path: Path, text: str, expected: str) -> None:
    toml = tmp_path / "et.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError, match="fix:") as raised:
        load_settings(toml)
    assert str(raised.value).startswith(expected)


def test_invalid_value_names_where_to_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    message = _error(monkeypatch, ELASTICTRAIN_SNAPSHOT__KEEP="abc")
    assert message.startswith("invalid config snapshot.keep='abc': ")
    assert message.endswith("fix: a valid keep in [snapshot] of the config file or "
                            "ELASTICTRAIN_SNAPSHOT__KEEP")


