"""One exception hierarchy for elastictrain.

Every message says what went wrong (field or path, the value) and what to do
next. Backend exceptions are translated at the module boundary that owns the
backend (storage for fsspec, dist for torch.distributed) and chained with
``raise ... from``.
"""

from __future__ import annotations

# Process exit codes (see README "Exit codes").
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a final snapshot is committed; resume me elsewhere.
# Preempted, but the final snapshot did not commit: resume me elsewhere, from an older one.
EXIT_PREEMPTED_UNSAVED = 76
EXIT_FATAL = 78  # EX_CONFIG: bad config or unrecoverable state; do not retry.
EXIT_HANG = 71  # the watchdog saw no progress; torchrun should restart the group.
EXIT_READER_GONE = 141  # 128 + SIGPIPE: a command's output was closed early (| head).


class ElasticTrainError(Exception):
    """Base class of every error elastictrain raises on purpose."""

    exit_code: int = 1


class ConfigError(ElasticTrainError):
    """A configuration value is invalid; the message names the field, value and fix."""

    exit_code = EXIT_FATAL


class ResumeMismatchError(ConfigError):
    """The snapshot cannot be resumed with the current job (dataset length, batch sizes)."""


class UnsafeStateError(ConfigError):
    """The state holds a value ``torch.load(weights_only=True)`` would refuse to load."""


class StorageError(ElasticTrainError):
    """A storage operation failed; the message names the URL (never credentials)."""


class StorageNotFoundError(StorageError):
    """The path, bucket or container does not exist."""


class StoragePermissionError(StorageError):
    """Access was denied or the location is read-only."""

    exit_code = EXIT_FATAL


class StorageConflictError(StorageError):
    """A create-only write found the object already there (another writer won)."""


class StorageTransientError(StorageError):
    """A retryable fault (throttling, connection reset) outlived its retries."""


class ObjectSizeMismatch(StorageError):
    """An object is not the size the reader was told it must be (``actual`` bytes):
    the store answered, so this is a fact about the object, not a failed read."""

    def __init__(self, message: str, actual: int) -> None:
        super().__init__(message)
        self.actual = actual


class SnapshotCorrupt(StorageError):
    """A snapshot's manifest or payload failed verification."""


class SnapshotUntrusted(SnapshotCorrupt):
    """With a signing key set, a manifest is unsigned or its signature does not verify:
    the snapshot is not ours and is never deserialized."""


class SnapshotUnloadable(ElasticTrainError):
    """A snapshot's payload verifies against its manifest but ``torch.load(weights_only=True)``
    refuses it: not storage corruption, and older snapshots of the same script fail the
    same way, so the run stops instead of falling back."""

    exit_code = EXIT_FATAL


class RestoreOverwrote(ElasticTrainError):
    """No committed snapshot verifies, and one of them was already read into the
    model's tensors (an in-place restore): the process cannot start fresh from the
    model's initial values, so it stops instead; nothing was deleted."""

    exit_code = EXIT_FATAL


class ReplicasDiverged(ElasticTrainError):
    """After a restore of replicated state, the ranks hold different parameters,
    optimizer state or step (snapshot/state/replica_check.py): the run stops before its first
    step rather than train on replicas that disagree; nothing was deleted."""

    exit_code = EXIT_FATAL


class SnapshotSuspect(ElasticTrainError):
    """The first steps after a restore made no sense (a non-finite loss or parameter, or
    a loss far above the one recorded with the snapshot): the snapshot was set aside and
    the next attempt restores the one before it (exit 1: torchrun restarts)."""


class SuspectLimit(ElasticTrainError):
    """Restores kept making no sense: ``snapshot.check_max_fallbacks`` snapshots in a row
    were set aside; a restart cannot fix it (exit 78)."""

    exit_code = EXIT_FATAL


class RunEndNotAgreed(ElasticTrainError):
    """At ``SnapshotManager.close()`` a peer rank failed, or did not reach its own
    ``close()`` in time: the run has not ended. A failure, so that the launcher restarts
    the workers, which resume from the newest snapshot and reach the end together."""


class PeerNodeLost(ElasticTrainError):
    """Before this rank's optimizer step, another node's rank never sent its record of
    the step (its connection ended, or nothing came in time): that node is lost. Raised
    before the step changes anything, so the rescue commits the step before it."""

    def __init__(self, ranks: list[int], step: int, why: str) -> None:
        super().__init__(f"rank(s) {ranks} of another node sent no record of step {step} "
                         f"before its optimizer step: {why}; the node is taken as lost")
        self.ranks, self.step = ranks, step


class SnapshotWriteFailed(StorageError):
    """Too many consecutive background persists failed."""
