"""env, config and log: the torchrun contract, precedence, errors, bound context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog

from elastictrain.core import log as et_log
from elastictrain.core.config import load_settings
from elastictrain.core.env import SHARE_STORE_FIX_VAR, WorkerEnv, launcher_environ
from elastictrain.core.errors import ConfigError
from elastictrain.runlog.events_read import read_events


def test_worker_env_reads_torchrun_contract() -> None:
    env = WorkerEnv.from_environ({
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "5",
        "TORCHELASTIC_RUN_ID": "job7", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
        "SLURM_RESTART_COUNT": "1", "JOBSET_RESTART_ATTEMPT": "4",
    })
    assert (env.rank, env.local_rank, env.world_size, env.group_rank) == (3, 1, 4, 1)
    assert (env.restart_count, env.max_restarts, env.run_id) == (2, 5, "job7")
    assert env.under_torchrun and env.is_distributed and not env.is_writer
    assert env.agent_store_shared  # the fix variable is not set
    assert env.scheduler_attempts == {"slurm_restart_count": 1, "jobset_restart_attempt": 4}


def test_worker_env_defaults_single_process_and_store_fix() -> None:
    env = WorkerEnv.from_environ({SHARE_STORE_FIX_VAR: "1"})
    assert (env.rank, env.world_size, env.under_torchrun) == (0, 1, False)
    assert not env.is_distributed and env.is_writer and not env.agent_store_shared


def test_worker_env_rejects_garbage() -> None:
    with pytest.raises(ConfigError, match="RANK='x'"):
        WorkerEnv.from_environ({"RANK": "x"})


def test_launcher_environ_sets_store_fix() -> None:
    assert launcher_environ()[SHARE_STORE_FIX_VAR] == "1"


def test_settings_precedence_toml_env_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "et.toml"
    toml.write_text('[snapshot]\nkeep = 7\nevery_steps = 11\n[storage]\nurl = "/from/toml"\n')
    monkeypatch.setenv("ELASTICTRAIN_SNAPSHOT__EVERY_STEPS", "13")
    settings = load_settings(toml, storage={"url": "/from/args"})
    assert settings.snapshot.keep == 7  # TOML over default
    assert settings.snapshot.every_steps == 13  # env over TOML
    assert settings.storage.url == "/from/args"  # arguments over everything


def test_settings_errors_name_field_value_and_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"snapshot\.keep=0: Input should be greater"):
        load_settings(snapshot={"keep": 0})
    with pytest.raises(ConfigError, match="set at least one"):
        load_settings(snapshot={"every_steps": None})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "missing.toml")


def test_storage_options_never_echoed_in_errors() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(storage={"storage_options": "key=AKIASECRET"})
    assert "AKIASECRET" not in str(info.value)


def test_events_carry_bound_context_and_go_to_file(tmp_path: Path) -> None:
    events_file = tmp_path / "ev.jsonl"
    et_log.configure("info", json_output=True, events_file=events_file)
    structlog.contextvars.clear_contextvars()
    et_log.bind(run_id="r1", rank=1, world_size=2, restart_count=3)
    et_log.bind_step(42)
    et_log.get_logger().info("snapshot.committed", size_bytes=10)
    (event,) = read_events(events_file)
    assert event["event"] == "snapshot.committed"
    assert {k: event[k] for k in ("run_id", "rank", "world_size", "restart_count", "step")} == {
        "run_id": "r1", "rank": 1, "world_size": 2, "restart_count": 3, "step": 42}
    structlog.contextvars.clear_contextvars()


def test_read_events_skips_torn_line(tmp_path: Path) -> None:
    f = tmp_path / "ev.jsonl"
    f.write_text(json.dumps({"event": "a"}) + "\n" + '{"event": "b", "tru')
    assert [e["event"] for e in read_events(f)] == ["a"]
