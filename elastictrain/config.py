"""Configuration: one pydantic model per component, loaded into ``Settings``.

Precedence, lowest first: defaults < TOML file (``ELASTICTRAIN_CONFIG`` or an
explicit path) < ``ELASTICTRAIN_*`` environment variables (nested with
``__``, e.g. ``ELASTICTRAIN_SNAPSHOT__KEEP=5``) < explicit arguments.
Validation happens where a model is built; a failure becomes a
:class:`~elastictrain.errors.ConfigError` naming the field, the value and a fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from elastictrain.env import getenv
from elastictrain.errors import ConfigError

ChecksumAlgorithm = Literal["crc32", "sha256"]
NoticeSignal = Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StorageConfig(_Model):
    """Where snapshots and events live, and how to reach it."""

    url: str = Field(default="./elastictrain-run", min_length=1)
    # Passed straight to fsspec.filesystem(); never logged (may hold secrets).
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    retries: int = Field(default=5, ge=0, le=50)
    retry_backoff_s: float = Field(default=0.2, gt=0, le=60)
    # Object stores: a payload up to multipart_threshold_bytes goes up in one PUT;
    # a larger one streams as a multipart upload (first part the threshold, then
    # parts of part_size_bytes, upload_concurrency at a time), so memory is bounded
    # by these settings, never by the state's size. S3 rejects parts under 5 MiB.
    multipart_threshold_bytes: int = Field(default=64 * 2**20, ge=5 * 2**20, le=5 * 2**30)
    part_size_bytes: int = Field(default=16 * 2**20, ge=5 * 2**20, le=5 * 2**30)
    upload_concurrency: int = Field(default=4, ge=1, le=64)


class SnapshotConfig(_Model):
    """When and how snapshots are taken, kept and restored."""

    # "auto": the Young/Daly interval from measured cost and failure history
    # (snapshot/interval.py), bounded by auto_min/max_interval_s.
    every_steps: Annotated[int, Field(ge=1)] | Literal["auto"] | None = 100
    every_seconds: Annotated[float, Field(gt=0)] | Literal["auto"] | None = None
    auto_mtbf_prior_s: float = Field(default=3600.0, gt=0)
    auto_min_interval_s: float = Field(default=1.0, gt=0)
    auto_max_interval_s: float = Field(default=3600.0, gt=0)
    keep: int = Field(default=3, ge=1)
    mode: Literal["sync", "async"] = "async"
    persister: Literal["thread", "process"] = "thread"  # measured: docs/persister.md
    checksum: ChecksumAlgorithm = "crc32"
    # auto: "each" on a local file system, "broadcast" elsewhere (snapshot/restore.py)
    restore_mode: Literal["auto", "each", "broadcast"] = "auto"
    max_consecutive_failures: int = Field(default=3, ge=1)
    retry_backoff_s: float = Field(default=0.5, gt=0)

    @field_validator("every_steps", "every_seconds", mode="before")
    @classmethod
    def _auto_or_number(cls, value: Any, info: ValidationInfo) -> Any:
        """One clear error for a trigger that is neither a number in range nor "auto"."""
        if value is None:
            return None
        steps = info.field_name == "every_steps"
        fix = ("must be a whole number of steps >= 1, 'auto' or unset" if steps
               else "must be a number of seconds > 0, 'auto' or unset")
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, bool):
            raise ValueError(fix)
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(fix) from None
        if (steps and (number < 1 or not number.is_integer())) or number <= 0:
            raise ValueError(fix)
        return int(number) if steps else number

    @model_validator(mode="after")
    def _check_auto(self) -> SnapshotConfig:
        if self.auto_min_interval_s > self.auto_max_interval_s:
            raise ValueError(
                f"snapshot.auto_min_interval_s={self.auto_min_interval_s} is above "
                f"snapshot.auto_max_interval_s={self.auto_max_interval_s}; fix: lower the "
                "minimum or raise the maximum")
        return self

    @property
    def auto(self) -> bool:
        """Whether the interval is chosen automatically (either trigger is ``"auto"``)."""
        return "auto" in (self.every_steps, self.every_seconds)


class DistConfig(_Model):
    """Process-group setup."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    init_timeout_s: float = Field(default=120.0, gt=0)
    collective_timeout_s: float = Field(default=600.0, gt=0)


class PreemptConfig(_Model):
    """Spot preemption notices (``elastictrain.preempt``): where they come from and
    how long the final snapshot may take."""

    enabled: bool = True
    signals: list[NoticeSignal] = Field(default=["SIGTERM", "SIGUSR1"])
    file: str | None = Field(default=None, description="a notice when this path exists")
    url: str | None = Field(default=None, description="metadata endpoint polled for a notice")
    url_style: Literal["aws", "gcp", "azure", "plain"] = "plain"
    poll_interval_s: float = Field(default=1.0, gt=0, le=60)
    # GCP and Azure give about 30 s, AWS about 120 s: the smallest is the safe budget.
    grace_period_s: float = Field(default=30.0, gt=0)


class WatchdogConfig(_Model):
    """Hang detection (``elastictrain.watchdog``): no step progress for ``timeout_s``
    (``startup_timeout_s`` before the first step) dumps stacks and exits."""

    enabled: bool = True
    timeout_s: float = Field(default=300.0, gt=0)
    startup_timeout_s: float = Field(default=900.0, gt=0)
    check_interval_s: float = Field(default=1.0, gt=0, le=60)
    backstop: bool = Field(default=True, description="faulthandler exit if the GIL is stuck")


class LaunchDefaults(_Model):
    """What ``elastictrain run`` adds to torchrun's options when neither the command
    line nor a ``PET_*`` variable sets them."""

    max_restarts: int = Field(default=3, ge=0)
    monitor_interval_s: float = Field(default=0.1, gt=0)
    rdzv_backend: str = Field(default="c10d", min_length=1)
    # Tuned on this kind of machine: scale-down took 46 s with torch's defaults and
    # 9 s with these; keep-alive 1 s x 2 caused a split brain.
    rdzv_conf: str = "last_call_timeout=1,keep_alive_interval=2,keep_alive_max_attempt=3"
    # SIGTERM -> SIGKILL grace for workers when the launcher is signalled: the final
    # snapshot needs it (torchrun's default is 30 s).
    shutdown_timeout_s: int = Field(default=90, ge=1)
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


class LogConfig(_Model):
    """Structured logging."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    json_output: bool | None = Field(default=None, description="None: JSON off a TTY")
    events_dir: str | None = None


class Settings(BaseSettings):
    """All elastictrain settings; see the module docstring for precedence."""

    model_config = SettingsConfigDict(
        env_prefix="ELASTICTRAIN_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    run_id: str | None = None
    storage: StorageConfig = Field(default_factory=StorageConfig)
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    preempt: PreemptConfig = Field(default_factory=PreemptConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    launch: LaunchDefaults = Field(default_factory=LaunchDefaults)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        snap = self.snapshot
        if snap.every_steps is None and snap.every_seconds is None:
            raise ValueError(
                "snapshot.every_steps and snapshot.every_seconds are both unset: no snapshot "
                "would ever be taken; set at least one"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_path = _TOML_PATH.get("path") or getenv("ELASTICTRAIN_CONFIG")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_path:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)


# pydantic-settings resolves sources on a class hook; the path travels through here.
_TOML_PATH: dict[str, str | None] = {"path": None}


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build Settings from defaults, a TOML file, the environment and ``overrides``.

    Args:
        config_file: optional TOML file (also settable with ``ELASTICTRAIN_CONFIG``).
        **overrides: explicit values, nested as dicts: ``snapshot={"keep": 5}``.

    Raises:
        ConfigError: a value is invalid or the file is missing; the message
            names the field, the value and the fix.
    """
    if config_file is not None and not Path(config_file).is_file():
        raise ConfigError(
            f"config file {str(config_file)!r} does not exist; fix: pass an existing TOML file"
        )
    _TOML_PATH["path"] = str(config_file) if config_file is not None else None
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    finally:
        _TOML_PATH["path"] = None


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``field=value: what is wrong``; secrets are never echoed."""
    lines = []
    for err in exc.errors():
        message = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a cross-field rule: its message names the fields
            lines.append(f"invalid config: {message}")
            continue
        field = ".".join(str(p) for p in err["loc"])
        shown = "<redacted>" if "storage_options" in field else repr(err.get("input"))
        lines.append(f"invalid config {field}={shown}: {message}")
    return "; ".join(lines)


def validated(model: type[_Model], **values: Any) -> Any:
    """Build one component model, turning validation failures into ConfigError."""
    try:
        return model(**values)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
