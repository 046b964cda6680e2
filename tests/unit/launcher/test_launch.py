"""`elastictrain run` without starting workers: which torchrun options get our defaults,
usage errors, the exit-code meanings, and the agent hook into torchrun."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from elastictrain.core.config import STANDBY_PRELOAD, LaunchDefaults
from elastictrain.core.errors import ConfigError
from elastictrain.launcher import run_args
from elastictrain.launcher.launch import standby_modules
from elastictrain.launcher.run_args import torchrun_argv
from elastictrain.launcher.run_help import torchrun_parser

DEFAULTS = LaunchDefaults()
def added(user: list[str], environ: dict[str, str] | None = None,
          run_id: str | None = None) -> dict[str, str]:
    """The --name=value options elastictrain adds in front of the user's argv."""
    argv = torchrun_argv(user, DEFAULTS, environ or {}, run_id)
    assert argv[len(argv) - len(user):] == user  # the user's argv is kept, last
    return dict(a.partition("=")[::2] for a in argv[:len(argv) - len(user)])


def test_defaults_fill_what_the_user_left_unset() -> None:
    o = added(["--nproc-per-node=2", "train.py", "--lr=1"])
    assert o["--max-restarts"] == "3" and o["--monitor-interval"] == "0.1"
    assert o["--shutdown-timeout"] == "90"  # above torchrun's 30 s: time for a final snapshot
    assert "SIGUSR1" in o["--signals-to-handle"] and "SIGTERM" in o["--signals-to-handle"]
    assert o["--rdzv-backend"] == "c10d" and o["--rdzv-endpoint"] == "127.0.0.1:0"
    assert o["--rdzv-conf"] == DEFAULTS.rdzv_conf and o["--rdzv-id"].startswith("et-")


def test_command_line_and_pet_variables_win() -> None:
    o = added(["--max-restarts", "7", "--shutdown_timeout=5", "--rdzv-id=job", "train.py"],
              {"PET_MONITOR_INTERVAL": "2", "PET_RDZV_CONF": "timeout=60"})
    assert "--max-restarts" not in o and "--shutdown-timeout" not in o
    assert "--monitor-interval" not in o and "--rdzv-conf" not in o
    assert "--rdzv-id" not in o


def test_torch_shutdown_timeout_variable_is_respected() -> None:
    assert "--shutdown-timeout" not in added(["train.py"],
                                             {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"})


def test_standalone_keeps_torchruns_rendezvous_and_config_run_id_is_used() -> None:
    o = added(["--standalone", "train.py"])
    assert not {"--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"} & set(o)
    assert added(["train.py"], run_id="exp7")["--rdzv-id"] == "exp7"


def test_multi_node_needs_an_endpoint() -> None:
    with pytest.raises(ConfigError, match=r"--nnodes=1:2 needs --rdzv-endpoint.*fix"):
        torchrun_argv(["--nnodes=1:2", "train.py"], DEFAULTS, {})
    o = added(["--nnodes=1:2", "train.py"], {"PET_RDZV_ENDPOINT": "node0:29400"})
    assert "--rdzv-endpoint" not in o and "--rdzv-id" not in o  # same id on every node: theirs
    assert o["--rdzv-conf"] == DEFAULTS.rdzv_conf


def test_agent_hook_is_installed_only_while_running() -> None:
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from elastictrain.launcher.install import installed

    with installed() as built:
        assert launcher_api.LocalElasticAgent is not LocalElasticAgent
        assert built.agent is None  # torchrun builds it at its first rendezvous
    assert launcher_api.LocalElasticAgent is LocalElasticAgent


def test_a_torch_without_shutdown_timeout_gets_the_grace_from_the_agent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's torchrun has no --shutdown-timeout: elastictrain must not pass it
    (torchrun would refuse the command line), and its agent applies the grace itself."""
    monkeypatch.setattr(run_args, "torchrun_knows", lambda option: False)
    assert "--shutdown-timeout" not in added(["train.py"])
    bare = argparse.Namespace()
    assert run_args.shutdown_timeout_s(bare, DEFAULTS, {}) == DEFAULTS.shutdown_timeout_s
    assert run_args.shutdown_timeout_s(bare, DEFAULTS,
                                     {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}) == 45
    assert run_args.shutdown_timeout_s(argparse.Namespace(shutdown_timeout=7), DEFAULTS,
                                     {}) == 7


@pytest.mark.parametrize("script_args,added", [
    (["./ckpt", "--steps=10"], []),
    (["s3://bucket/run"], ["s3fs"]),
    (["--storage=S3://bucket/run", "--mirror", "s3a://other/run"], ["s3fs"]),
    (["file:///tmp/run", "gs3://not-s3"], []),
])
def test_the_standby_preloads_the_client_of_an_object_store_the_script_names(
        script_args: list[str], added: list[str]) -> None:
    base = list(STANDBY_PRELOAD)
    assert standby_modules(base, script_args) == base + added
    assert standby_modules(["torch", "s3fs"], script_args) == ["torch", "s3fs"]  # once




@pytest.mark.parametrize("after", [["--nproc-per-node", "2"], ["--nnodes=1:2"],
                                   ["--max-restarts", "3"], ["--standalone"], ["--no-view"]])
def test_a_job_shaping_option_after_the_script_is_refused(tmp_path: Path,
                                                          after: list[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    args = torchrun_parser().parse_args([str(script), "./ckpt", *after])
    with pytest.raises(ConfigError, match=r"comes after the script .*fix: put it before"):
        run_args.check_script(args)


def test_the_scripts_own_options_pass(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    run_args.check_script(torchrun_parser().parse_args(
        [str(script), "./ckpt", "--log-dir=x", "--steps", "5", "--nodes", "2"]))
