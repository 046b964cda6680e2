"""Launching workers under torchrun (``torch.distributed.run``) with our defaults.

We never fork torchrun: we build its argument list and call its public
``main`` in a launcher process whose environment carries the store fix
(see :func:`elastictrain.env.launcher_environ`).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from elastictrain.env import launcher_environ

# Rendezvous keep-alive/last-call tuned on this kind of machine: scale-down took
# 46 s with torch's defaults and 9 s with these. 1 s x 2 caused a split brain.
DEFAULT_RDZV_CONF = "last_call_timeout=1,keep_alive_interval=2,keep_alive_max_attempt=3"


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
    """Start a torchrun agent process (in its own session, so it can be killed as a
    unit) and return it; the caller waits for it."""
    return subprocess.Popen(
        [sys.executable, "-m", "elastictrain.launch", *spec.argv()],
        env=launcher_environ(extra_env),
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        start_new_session=True,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Run torchrun's own main with our environment fix applied in this process."""
    import os

    os.environ.update(launcher_environ())
    from torch.distributed.run import main as torchrun_main

    torchrun_main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
