"""Starting an ``elastictrain run`` launcher as a child process: the demo, the chaos harness,
the tests and the benchmarks describe one torchrun invocation (``LaunchSpec``) and start it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from elastictrain.core.env import launcher_environ

if TYPE_CHECKING:  # the agent imports torch's launcher: only when a run starts
    pass

from elastictrain.core.config import LaunchDefaults

# Kept importable for callers of the walking skeleton; the value lives in config.

# Kept importable for callers of the walking skeleton; the value lives in config.
DEFAULT_RDZV_CONF = LaunchDefaults().rdzv_conf
EVENTS_DIR_VAR = "ELASTICTRAIN_LOG__EVENTS_DIR"


# -- launching a torchrun agent process (the demo, tests, benchmarks) ----------------------
@dataclass
class LaunchSpec:
    """One torchrun invocation: workers per node, nodes, restarts and rendezvous."""

    nproc_per_node: int
    module: str | None = None
    script: str | None = None
    script_args: Sequence[str] = ()
    nnodes: str = "1"
    max_restarts: int = 3
    monitor_interval_s: float = 0.1
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "127.0.0.1:0"
    rdzv_id: str = "elastictrain"
    rdzv_conf: str = DEFAULT_RDZV_CONF
    log_dir: str | None = None
    shutdown_timeout_s: int | None = None
    events_dir: str | None = None
    extra_torchrun_args: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        """torchrun's command-line arguments for this spec."""
        args = [
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--max-restarts={self.max_restarts}",
            f"--monitor-interval={self.monitor_interval_s}",
            f"--rdzv-backend={self.rdzv_backend}",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf={self.rdzv_conf}",
        ]
        if self.log_dir:
            args.append(f"--log-dir={self.log_dir}")
        if self.shutdown_timeout_s is not None:
            args.append(f"--shutdown-timeout={self.shutdown_timeout_s}")
        args += self.extra_torchrun_args
        if self.module:
            args += ["-m", self.module]
        elif self.script:
            args.append(self.script)
        else:
            raise ValueError("LaunchSpec needs a module or a script")
        return args + list(self.script_args)


def start_torchrun(spec: LaunchSpec, stdout: IO[str] | int | None = None,
                   extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start an ``elastictrain run`` launcher process (in its own session, so it can be
    killed as a unit) and return it; the caller waits for it."""
    env = dict(extra_env or {})
    if spec.events_dir:
        env[EVENTS_DIR_VAR] = spec.events_dir
    return subprocess.Popen(
        [sys.executable, "-m", "elastictrain.launcher.launch", *spec.argv()],
        env=launcher_environ(env),
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        start_new_session=True,
    )
