"""WorkerEnv: the only reader of torchrun and scheduler environment variables.

torchrun's contract (``torch.distributed.run``) sets RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT,
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS and
TORCHELASTIC_RUN_ID for every worker. Schedulers add their own attempt
counters (Slurm requeues, JobSet restarts, SkyPilot recoveries), which we keep
so events can say which attempt of the whole job they belong to.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

SHARE_STORE_FIX_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
ENV_PREFIX = "ELASTICTRAIN_"
CONFIG_FILE_VAR = "ELASTICTRAIN_CONFIG"
# ELASTICTRAIN_* names read outside Settings; every other one must name a setting
# (config.check_environment), so a knob read with getenv() is listed here.
SIGNING_KEY_VAR = "ELASTICTRAIN_SIGNING_KEY"  # a secret: never a setting, never logged
LAUNCH_ID_VAR = "ELASTICTRAIN_LAUNCH_ID"  # set by the launcher for its workers
# Set by the launcher for its workers: where they mark the run's agreed end (runend.py).
END_DIR_VAR = "ELASTICTRAIN_END_DIR"
# The node's shared tmpfs holding the memory tier's per-user root (default /dev/shm).
SHM_VAR = "ELASTICTRAIN_SHM"
# Set by the launcher for its workers: where they mark a rescue (snapshot/memory/rescue.py).
RESCUE_MARKS_VAR = "ELASTICTRAIN_RESCUE_MARKS"
# Read by the container entrypoint (deploy/docker/entrypoint.sh), not by Python.
EXIT_PREEMPTED_AS_VAR = "ELASTICTRAIN_EXIT_PREEMPTED_AS"
# The ELASTICTRAIN_* names that are not Settings fields (the misspelling check allows them).
OUTSIDE_SETTINGS = frozenset({CONFIG_FILE_VAR, SIGNING_KEY_VAR, LAUNCH_ID_VAR,
                              END_DIR_VAR, EXIT_PREEMPTED_AS_VAR, SHM_VAR,
                              RESCUE_MARKS_VAR})


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        from elastictrain.core.errors import ConfigError

        raise ConfigError(
            f"environment variable {name}={raw!r} is not an integer; "
            "fix: unset it or launch through torchrun / elastictrain run"
        ) from exc


@dataclass(frozen=True)
class WorkerEnv:
    """What a worker knows about its place in the job, read once at start."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = "local"
    master_addr: str | None = None
    master_port: int | None = None
    under_torchrun: bool = False
    agent_store_shared: bool = True
    # torchrun's word that the workers use its agent's store: with the store sharing
    # turned off, only its static rendezvous (no --standalone, no --rdzv-backend) does.
    uses_agent_store: bool = False
    scheduler_attempts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> WorkerEnv:
        """Build from ``os.environ`` (or a given mapping, for tests)."""
        env = os.environ if env is None else env
        port = env.get("MASTER_PORT")
        return cls(
            rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=_int(env, "WORLD_SIZE", 1),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
            group_rank=_int(env, "GROUP_RANK", 0),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS", 0),
            run_id=env.get("TORCHELASTIC_RUN_ID") or env.get("ELASTICTRAIN_RUN_ID") or "local",
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(port) if port else None,
            under_torchrun="TORCHELASTIC_RUN_ID" in env,
            agent_store_shared=env.get(SHARE_STORE_FIX_VAR, "0") not in ("1", "true", "True"),
            uses_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            scheduler_attempts=_scheduler_attempts(env),
        )

    @property
    def is_distributed(self) -> bool:
        """True when a process group should be formed (torchrun or MASTER_ADDR set)."""
        return self.world_size > 1 or self.master_addr is not None

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes snapshots; DDP replicas are identical."""
        return self.rank == 0


def _scheduler_attempts(env: Mapping[str, str]) -> dict[str, int]:
    """Attempt counters of the engines we have recipes for, where present."""
    names = {
        "slurm_restart_count": "SLURM_RESTART_COUNT",
        "jobset_restart_attempt": "JOBSET_RESTART_ATTEMPT",
        "skypilot_task_attempt": "SKYPILOT_TASK_ATTEMPT",
    }
    found: dict[str, int] = {}
    for key, var in names.items():
        if env.get(var, "").isdigit():
            found[key] = int(env[var])
    for key, var in {"slurm_job_id": "SLURM_JOB_ID"}.items():
        if env.get(var, "").isdigit():
            found[key] = int(env[var])
    return found


def launcher_environ(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a torchrun agent we start: ours plus the store fix.

    torch 2.13's agent shares one TCPStore across restart attempts and restarted
    gloo workers read the previous attempt's addresses; the agent-side
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` fixes it single- and multi-node.
    """
    child = dict(os.environ)
    child[SHARE_STORE_FIX_VAR] = "1"
    child.setdefault("PYTHONUNBUFFERED", "1")
    child.update(extra or {})
    return child


def elastictrain_environ() -> dict[str, str]:
    """Every ``ELASTICTRAIN_*`` variable, its name upper-cased (pydantic-settings matches
    names case-insensitively)."""
    return {name.upper(): value for name, value in os.environ.items()
            if name.upper().startswith(ENV_PREFIX)}


def getenv(name: str, default: str | None = None) -> str | None:
    """The one sanctioned raw environment read, for the few knobs outside Settings."""
    return os.environ.get(name, default)


_MIN_SIGNING_KEY_CHARS = 16


def signing_key() -> bytes | None:
    """The manifest signing key from ``ELASTICTRAIN_SIGNING_KEY``, or None when unset.

    Raises:
        ConfigError: the key is too short to be a secret (the message never quotes it).
    """
    raw = os.environ.get(SIGNING_KEY_VAR)
    if not raw:
        return None
    if len(raw) < _MIN_SIGNING_KEY_CHARS:
        from elastictrain.core.errors import ConfigError

        raise ConfigError(
            f"{SIGNING_KEY_VAR} is {len(raw)} characters, fewer than "
            f"{_MIN_SIGNING_KEY_CHARS}; fix: use a random secret, e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`"
        )
    return raw.encode()
