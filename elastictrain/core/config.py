"""Configuration: one pydantic model per component, loaded into ``Settings``.

Precedence, lowest first: defaults < TOML file (``ELASTICTRAIN_CONFIG`` or an
explicit path) < ``ELASTICTRAIN_*`` environment variables (nested with
``__``, e.g. ``ELASTICTRAIN_SNAPSHOT__KEEP=5``) < explicit arguments.
Validation happens where a model is built; a failure becomes a
:class:`~elastictrain.core.errors.ConfigError` naming the field, the value and a fix.
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

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
    SettingsError,
    TomlConfigSettingsSource,
)

from elastictrain.core.env import (
    CONFIG_FILE_VAR,
    ENV_PREFIX,
    OUTSIDE_SETTINGS,
    elastictrain_environ,
    getenv,
)
from elastictrain.core.errors import ConfigError

if sys.version_info >= (3, 11):
    from tomllib import TOMLDecodeError
else:  # pydantic-settings reads TOML with tomli there
    from tomli import TOMLDecodeError

ChecksumAlgorithm = Literal["crc32", "sha256"]
NoticeSignal = Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FaultsConfig(_Model):
    """Storage faults injected on purpose (``elastictrain chaos``; see docs/chaos.md).

    Off unless set, e.g. ``ELASTICTRAIN_STORAGE__FAULTS__READ_ERROR_P=0.05``.
    """

    seed: int = 0
    read_error_p: float = Field(default=0.0, ge=0, le=1)
    write_error_p: float = Field(default=0.0, ge=0, le=1)
    latency_s: float = Field(default=0.0, ge=0, le=60)
    # The first crash_writes payload writes of each process fail after this many bytes.
    crash_after_bytes: int | None = Field(default=None, ge=0)
    crash_writes: int = Field(default=1, ge=0)


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
    faults: FaultsConfig | None = None  # chaos testing only


class SnapshotConfig(_Model):
    """When and how snapshots are taken, kept and restored."""

    # "auto": the Young/Daly interval from measured cost and failure history
    # (snapshot/schedule/interval.py), bounded by auto_min/max_interval_s.
    every_steps: Annotated[int, Field(ge=1)] | Literal["auto"] | None = 100
    every_seconds: Annotated[float, Field(gt=0)] | Literal["auto"] | None = None
    auto_mtbf_prior_s: float = Field(default=3600.0, gt=0)
    auto_min_interval_s: float = Field(default=1.0, gt=0)
    auto_max_interval_s: float = Field(default=3600.0, gt=0)
    keep: int = Field(default=3, ge=1)
    # close() commits a durable snapshot of the last step unless one exists: a relaunch
    # of the finished run, or a restart for a node that joins while the workers close,
    # resumes there instead of training the steps since the last snapshot again.
    save_on_close: bool = True
    mode: Literal["sync", "async"] = "async"
    persister: Literal["thread", "process"] = "thread"  # the two compared: docs/persister.md
    # "low": the persister thread or process runs at nice +10 and best-effort I/O level 7,
    # so the training loop (and its data loading) comes first where they compete for a
    # core or the disk, and the snapshot is durable later; "normal": the worker's own
    # priorities (docs/performance.md#background-priority).
    persister_priority: Literal["low", "normal"] = "normal"
    # The durable tier's background writes held to this many MB (10^6 bytes) a second,
    # checksum and copy included; None: as fast as they go. Lifted when the run ends
    # (close, a preemption notice). Trades a snapshot durable later for the loop's rate
    # where the persist's memory traffic slows it (docs/performance.md#pacing-the-persist).
    persist_max_mb_s: float | None = Field(default=None, gt=0)
    checksum: ChecksumAlgorithm = "crc32"
    # auto: "each" on a local file system, "broadcast" elsewhere (snapshot/durable/restore.py)
    restore_mode: Literal["auto", "each", "broadcast"] = "auto"
    max_consecutive_failures: int = Field(default=3, ge=1)
    retry_backoff_s: float = Field(default=0.5, gt=0)
    # Seconds between `train.progress` events (step, loss) per rank; a time check per
    # step, no per-step logging. None: no such events (views then see snapshot steps).
    progress_every_s: float | None = Field(default=5.0, gt=0)
    # The node-memory tier (docs/memory-tier.md): a snapshot every `memory_every` steps
    # to a node-local directory, one per node; "auto": Young/Daly from the memory
    # snapshot's own cost and the MTBF estimate (docs/interval.md); None: off.
    memory_every: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None
    # Default: /dev/shm/elastictrain-<uid>/run-<hash of the storage URL>, one per user
    # and durable storage (snapshot/memory/memory.py); 0700, never inside durable storage.
    memory_dir: str | None = None
    # A memory directory no process uses and untouched this long is removed by the next
    # run of the same user on the node (a relaunch of its run would have reused it).
    memory_max_idle_s: float = Field(default=3600.0, gt=0)
    # With a memory tier: on an uncaught error, a surviving rank commits the last step
    # every rank completed to its node's memory (docs/memory-tier.md#rescue).
    rescue: bool = True
    # With a memory tier on several nodes: how many other nodes receive each rank's
    # step-boundary records (the rescue across nodes), and whether a node lacking the
    # newest memory snapshot receives it from a node holding it instead of reading
    # durable storage (0: nothing crosses nodes). docs/memory-tier.md#across-nodes
    memory_replicas: int = Field(default=1, ge=0)
    # Copy parameters and optimizer state behind the loop: while the next forward and
    # backward run; the optimizer's next step() waits for the copy. A copy whose source
    # changed in place before it was done is dropped, and copies are made at once from
    # then on. "auto": on wherever it applies (async mode, a torch.optim optimizer=, a
    # model that is not sharded); true: the same, and an error where it cannot apply
    # (docs/performance.md#copy-behind).
    overlap_copy: bool | Literal["auto"] = "auto"
    # After every restore the first check_steps steps are watched: a non-finite loss or
    # parameter, or a loss above check_loss_factor times the one recorded with the
    # snapshot, sets the snapshot aside and restarts from the one before, at most
    # check_max_fallbacks times in a row (docs/restore.md#checked-for-sense). 0: off.
    check_steps: int = Field(default=20, ge=0)
    check_loss_factor: float = Field(default=4.0, gt=1)
    check_max_fallbacks: int = Field(default=2, ge=0)

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
        if self.overlap_copy is True and self.mode == "sync":
            raise ValueError(
                "snapshot.overlap_copy=true copies behind the loop and needs "
                "snapshot.mode='async' (it is 'sync'); fix: unset one of them")
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
    # DDP's gradients summed over the ranks in rank order, whatever DDP's bucket layout
    # (worker/exact_reduce.py): a resume at any rank count then ends on the uninterrupted
    # run's weights bit for bit. Registered by the first SnapshotManager on a DDP model
    # without a comm hook of its own; its cost: docs/scale.md#bit-exact-resume.
    fixed_order_reduction: bool = False


class PreemptConfig(_Model):
    """Spot preemption notices (``elastictrain.worker.preempt``): where they come from and
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
    """Hang detection (``elastictrain.worker.watchdog``): no step progress for ``timeout_s``
    (``startup_timeout_s`` before the first step) dumps stacks and exits."""

    enabled: bool = True
    timeout_s: float = Field(default=300.0, gt=0)
    startup_timeout_s: float = Field(default=900.0, gt=0)
    check_interval_s: float = Field(default=1.0, gt=0, le=60)
    backstop: bool = Field(default=True, description="faulthandler exit if the GIL is stuck")


ModuleName = Annotated[str, Field(pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")]
# torch._dynamo: DDP and the optimizers import it on first use. The package imports its
# API on first use, so its two heavy modules are named here.
STANDBY_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch.optim",
                   "torch._dynamo", "elastictrain.runtime", "elastictrain.snapshot.manager")
# An object store's client, preloaded too when the launched command names a URL of its
# scheme (skipped where the extra is not installed): a job on local or shared disk does
# not pay its import in every launch (docs/recovery.md).
STORAGE_CLIENTS = {"s3": "s3fs", "s3a": "s3fs"}


class LaunchDefaults(_Model):
    """What ``elastictrain run`` adds to torchrun's options when neither the command
    line nor a ``PET_*`` variable sets them."""

    max_restarts: int = Field(default=3, ge=0)
    monitor_interval_s: float = Field(default=0.1, gt=0)
    rdzv_backend: str = Field(default="c10d", min_length=1)
    # A short last call forms a smaller group soon after a node is lost; keep-alives
    # that tolerate a busy node's delays do not split the group (docs/preemption.md).
    rdzv_conf: str = "last_call_timeout=1,keep_alive_interval=2,keep_alive_max_attempt=3"
    # SIGTERM -> SIGKILL grace for workers when the launcher is signalled: the final
    # snapshot needs it (torchrun's default is 30 s).
    shutdown_timeout_s: int = Field(default=90, ge=1)
    # Once a worker exited 0, a peer whose process tree used no CPU for this long is
    # stuck in its exit (stopped, deadlocked in a destructor): the agent kills it and
    # torchrun restarts the group, which restores and finishes again (docs/faults.md).
    exit_timeout_s: float = Field(default=60.0, gt=0)
    # After a worker failed, the agent stops the others only once a survivor writing a
    # rescue (docs/memory-tier.md#rescue) is done, or after this long; when a node joins,
    # once its workers saved the step they are at (docs/elastic-resume.md), or as long.
    rescue_timeout_s: float = Field(default=30.0, gt=0)
    # A survivor armed for a rescue (memory tier on) that has not met its error yet gets
    # this long to begin one before the agent stops it.
    rescue_start_timeout_s: float = Field(default=5.0, gt=0)
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    # A crash loop: this many attempts in a row whose first failing worker raised the
    # same error (type, message, file:line) at the same step, or before et.init() the
    # same type at the same file:line: a restart cannot help, the launcher stops with
    # 78 instead of using up its restarts. 0: never stop early.
    crash_loop_failures: int = Field(default=2, ge=0)
    # Workers are forked from a standby process that imported these modules once, so
    # a restarted worker does not pay torch's imports again (docs/recovery.md).
    # False: every worker is a new interpreter, as with plain torchrun.
    standby: bool = True
    standby_preload: list[ModuleName] = Field(default_factory=lambda: list(STANDBY_PRELOAD))


class LogConfig(_Model):
    """Structured logging."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    json_output: bool | None = Field(default=None, description="None: JSON off a TTY")
    events_dir: str | None = None
    # Object storage only: how often a process's event file is copied to
    # <storage>/events/<run id>/ (and once more at exit).
    upload_interval_s: float = Field(default=10.0, gt=0, le=3600)


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
        toml_path = _TOML_PATH.get("path")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_path:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)


# pydantic-settings resolves sources on a class hook; the path travels through here.
_TOML_PATH: dict[str, str | None] = {"path": None}


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build Settings from defaults, a TOML file, the environment and ``overrides``.

    Args:
        config_file: optional TOML file (else ``ELASTICTRAIN_CONFIG``, if set).
        **overrides: explicit values, nested as dicts: ``snapshot={"keep": 5}``.

    Raises:
        ConfigError: an unknown ``ELASTICTRAIN_*`` name, a missing or malformed
            file, or an invalid value; the message names the variable, file or
            field, the value (never a secret) and the fix.
    """
    check_environment(elastictrain_environ())
    toml_path = _config_file(config_file)
    _TOML_PATH["path"] = toml_path
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    except TOMLDecodeError as exc:
        raise ConfigError(f"config file {toml_path}: TOML syntax error: {exc}; fix: correct "
                          "that line (syntax: https://toml.io)") from None
    except SettingsError as exc:  # the environment checks above should leave none
        raise ConfigError(f"invalid ELASTICTRAIN_* environment: {exc}; fix: see "
                          "docs/configuration.md") from None
    finally:
        _TOML_PATH["path"] = None


def _config_file(config_file: str | Path | None) -> str | None:
    """The TOML file to read (an argument wins over ``ELASTICTRAIN_CONFIG``), checked."""
    source = "config file"
    if config_file is None:
        config_file = getenv(CONFIG_FILE_VAR) or None
        source = CONFIG_FILE_VAR
    if config_file is None:
        return None
    path = Path(config_file)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        unset = f" or unset {CONFIG_FILE_VAR}" if source == CONFIG_FILE_VAR else ""
        raise ConfigError(f"{source}={str(config_file)!r} {what}; fix: name an existing TOML "
                          f"file{unset}")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{source}={str(config_file)!r} cannot be read ({exc.strerror}); "
                          "fix: make it readable by this user") from None
    return str(path)


def check_environment(environ: Mapping[str, str]) -> None:
    """Every ``ELASTICTRAIN_*`` name must be a setting and structured values valid JSON.

    pydantic-settings reads only the names it knows, so a misspelt one (a plural
    section, an unknown field) would otherwise be ignored and the run use defaults.

    Raises:
        ConfigError: naming the variable (never its value: it may be a secret), the
            closest valid name, and the fix.
    """
    known = _env_names(Settings, ENV_PREFIX)
    # A dict setting also takes its keys one by one: ..._STORAGE_OPTIONS__ANON=true.
    open_prefixes = tuple(f"{n}__" for n, kind in known.items() if kind == "dict")
    for name, value in sorted(environ.items()):
        if name in OUTSIDE_SETTINGS or name.startswith(open_prefixes):
            continue
        if name not in known:
            close = _closest(name, [*known, *OUTSIDE_SETTINGS])
            hint = f"; did you mean {close}?" if close else ";"
            raise ConfigError(f"unknown setting {name} in the environment{hint} fix: rename or "
                              "unset it (every name: docs/configuration.md)")
        if known[name] != "value":
            _check_json(name, value, known[name])


def _closest(name: str, names: list[str]) -> str | None:
    """The valid name nearest ``name``: the section first, then the field within it (a
    whole-name match would let the long shared prefix decide)."""
    section, _, field = name.removeprefix(ENV_PREFIX).partition("__")
    sections = {n.removeprefix(ENV_PREFIX).split("__")[0] for n in names}
    found = difflib.get_close_matches(section, sections, n=1)
    if not found:
        return None
    if not field:
        return ENV_PREFIX + found[0]
    section_prefix = f"{ENV_PREFIX}{found[0]}__"
    fields = [n.removeprefix(section_prefix) for n in names if n.startswith(section_prefix)]
    close = difflib.get_close_matches(field, fields, n=1, cutoff=0.5)
    return section_prefix + close[0] if close else None


def _check_json(name: str, value: str, kind: str) -> None:
    example = {"dict": '\'{"anon": true}\'', "list": '\'["SIGTERM", "SIGUSR1"]\'',
               "section": '\'{"FIELD": VALUE}\''}[kind]
    kind = "list" if kind == "list" else "object"
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name} is not JSON ({exc.msg} at character {exc.pos}); fix: a "
                          f"JSON {kind} such as {example}") from None
    if not isinstance(parsed, dict if kind == "object" else list):
        raise ConfigError(f"{name} must be a JSON {kind}, got a {type(parsed).__name__}; "
                          f"fix: a JSON {kind} such as {example}")


def _env_names(model: type[BaseModel], prefix: str) -> dict[str, str]:
    """Every variable pydantic-settings reads for ``model`` → "section", "dict", "list"
    (JSON) or "value"."""
    names: dict[str, str] = {}
    for field_name, info in model.model_fields.items():
        name = f"{prefix}{field_name.upper()}"
        names[name] = _json_kind(info.annotation)
        section = _section_model(info.annotation)
        if section is not None:  # a section, or an optional one (storage.faults)
            names.update(_env_names(section, f"{name}__"))
    return names


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a section field: ``Model`` or ``Model | None``."""
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) \
        else (annotation,)
    models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
    return models[0] if len(models) == 1 else None


def _json_kind(annotation: Any) -> str:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    kinds = {get_origin(a) or a for a in (get_args(annotation) or (annotation,))} \
        if get_origin(annotation) in (Union, UnionType) else {get_origin(annotation)}
    if dict in kinds:
        return "dict"
    return "list" if list in kinds else "value"


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``field=value: what is wrong; fix``; secrets are never echoed."""
    lines = []
    for err in exc.errors():
        message = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a cross-field rule: its message names the fields
            lines.append(f"invalid config: {message}")
            continue
        loc = [str(p) for p in err["loc"]]
        field = ".".join(loc)
        if err["type"] == "extra_forbidden":  # never echo it: a misplaced secret, maybe
            lines.append(f"unknown setting {field}{_did_you_mean(loc)} fix: rename or remove "
                         "it (every setting: docs/configuration.md)")
            continue
        shown = "<redacted>" if "storage_options" in field else repr(err.get("input"))
        line = f"invalid config {field}={shown}: {message}"
        if len(loc) > 1:  # a section's field: name both places a user sets it
            line += (f"; fix: a valid {loc[1]} in [{loc[0]}] of the config file or "
                     f"{ENV_PREFIX}{loc[0].upper()}__{loc[1].upper()}")
        lines.append(line)
    return "; ".join(lines)


def _did_you_mean(loc: list[str]) -> str:
    """``; did you mean X?`` with the closest field of the same section, if any."""
    model: Any = Settings
    for part in loc[:-1]:
        info = getattr(model, "model_fields", {}).get(part)
        model = info.annotation if info is not None else None
    fields = list(getattr(model, "model_fields", {}))
    close = difflib.get_close_matches(loc[-1], fields, n=1)
    return f"; did you mean {'.'.join([*loc[:-1], close[0]])}?" if close else ";"


def validated(model: type[_Model], **values: Any) -> Any:
    """Build one component model, turning validation failures into ConfigError."""
    try:
        return model(**values)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
