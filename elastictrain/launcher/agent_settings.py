"""What the launcher tells its agent: ``launch.*`` settings and the run's directories."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from elastictrain.core.config import LaunchDefaults


@dataclass(frozen=True)
class AgentSettings:
    """What the launcher tells its agent (from ``launch.*`` and the run's directories)."""

    exit_timeout_s: float = 60.0  # launch.exit_timeout_s
    standby_preload: tuple[str, ...] | None = None  # None: no standby (launch.standby)
    rescue_dir: Path | None = None  # where survivors mark a rescue (rescue_marks.py)
    rescue_timeout_s: float = 30.0
    rescue_start_timeout_s: float = 5.0
    end_dir: Path | None = None  # where workers mark the run's agreed end (runend.py)
    shutdown_timeout_s: float | None = None  # the notice grace; None: torchrun's
    crash_loop_failures: int = 2  # launch.crash_loop_failures

    @classmethod
    def of(cls, launch: LaunchDefaults, rescue_dir: Path | None, end_dir: Path | None,
           shutdown_timeout_s: float | None) -> AgentSettings:
        return cls(exit_timeout_s=launch.exit_timeout_s,
                   standby_preload=tuple(launch.standby_preload) if launch.standby else None,
                   rescue_dir=rescue_dir, rescue_timeout_s=launch.rescue_timeout_s,
                   rescue_start_timeout_s=launch.rescue_start_timeout_s, end_dir=end_dir,
                   shutdown_timeout_s=shutdown_timeout_s,
                   crash_loop_failures=launch.crash_loop_failures)
