"""What a worker under plain torchrun says of a launch whose restarts are unreliable with
gloo: the shared store (fix: the variable), and, with the variable set, torchrun's
default static rendezvous (fix: --standalone or c10d); nothing for a good launch."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from elastictrain.core.env import WorkerEnv
from elastictrain.worker.dist import warn_about_the_launch

TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "0",
            "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(("environ", "said"), [
    ({}, "dist.store_shared"),  # the store shared across attempts
    ({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"},
     "dist.static_rendezvous"),  # no --standalone, no --rdzv-backend
    ({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"},
     None),  # --standalone or c10d: good
    ({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
      "TORCHELASTIC_MAX_RESTARTS": "0"}, None),  # no restarts to go wrong
])
def test_the_launch_warning(environ: dict[str, str], said: str | None) -> None:
    with capture_logs() as logs:
        assert warn_about_the_launch(WorkerEnv.from_environ({**TORCHRUN, **environ})) == said
    assert [e["event"] for e in logs] == ([said] if said else [])
    assert all(e["fix"] and e["why"] and e["log_level"] == "warning" for e in logs)


def test_no_warning_outside_torchrun() -> None:
    assert warn_about_the_launch(WorkerEnv.from_environ({"WORLD_SIZE": "2",
                                                         "MASTER_ADDR": "h"})) is None
