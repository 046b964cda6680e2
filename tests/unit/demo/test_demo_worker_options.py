"""The demo worker's snapshot options: ``--snapshot-every auto`` and ``--memory-every N``
reach the settings the SnapshotManager reads (scripts/bench_goodput.py uses them)."""

from __future__ import annotations

import pytest

from elastictrain.core.config import load_settings
from elastictrain.demo.worker import parse_args, settings_overrides


def test_snapshot_every_takes_a_number_or_auto() -> None:
    assert parse_args(["--storage=s", "--snapshot-every=40"]).snapshot_every == 40
    assert parse_args(["--storage=s", "--snapshot-every=AUTO"]).snapshot_every == "auto"
    assert parse_args(["--storage=s"]).memory_every is None
    assert parse_args(["--storage=s", "--memory-every=1"]).memory_every == 1


def test_bad_snapshot_every_names_the_value_and_fix(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--storage=s", "--snapshot-every=often"])
    assert "'often': not a number of steps; fix: a whole number >= 1 or 'auto'" in (
        capsys.readouterr().err)


def test_the_options_validate_as_snapshot_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse_args(["--storage=s", "--snapshot-every=auto", "--memory-every=3"])
    snapshot = load_settings(None, **settings_overrides(args)).snapshot
    assert snapshot.every_steps == "auto" and snapshot.memory_every == 3
    fixed = parse_args(["--storage=s", "--snapshot-every=40"])
    snapshot = load_settings(None, **settings_overrides(fixed)).snapshot
    assert snapshot.every_steps == 40 and snapshot.memory_every is None
    # Without --memory-every, the environment's setting is not overridden.
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY", "5")
    assert load_settings(None, **settings_overrides(fixed)).snapshot.memory_every == 5
