"""Rescue: when a worker dies, a surviving rank on its node commits the last step
every rank completed to the node-memory tier, so the restart loses (almost) nothing.

Replicated (DDP) state is the same on every rank at a step boundary, and a failed
step changes nothing a snapshot holds until ``optimizer.step()``: a survivor whose
parameters and buffers are unchanged since its last boundary still holds that step.
What it lacks is the other ranks' RNG states at that boundary. So at every boundary
each rank writes its RNG states to a node-local record (two slots, one ``pwrite``,
checksummed); on an uncaught error a survivor reads every rank's record of its own
step and commits a memory snapshot through the ordinary saver (manifest, checksums,
atomic rename). Anything not exact is skipped and said why: then the restart uses
the newest periodic snapshot, as without a rescue. Figures and limits:
docs/memory-tier.md#rescue.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import random
import struct
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from elastictrain.core.localfiles import open_private, private_dir
from elastictrain.core.log import get_logger
from elastictrain.handoff.rescue_marks import ARMED, RESCUING, launcher_marks_dir
from elastictrain.snapshot.format.tensorbytes import tensor_bytes

try:  # numpy is optional (as in rng.py)
    import numpy as np
except ImportError:  # pragma: no cover - numpy is installed with the test extra
    np = None  # type: ignore[assignment]

log = get_logger("elastictrain.snapshot")

BOUNDARY_DIR = "boundary"
_RESCUED = "rescued-"  # + the step of a committed rescue
_MAGIC = 0x45545242  # "ETRB": taken at the step boundary
# "ETRP": taken before the optimizer step, sent to other nodes then (snapshot/rescuer.py):
# the boundary's own record whenever nothing draws random numbers in between.
_MAGIC_PRE_STEP = 0x45545250
# magic, step, world size, restart count, resumed-from step, payload length, crc32
_HEADER = struct.Struct("<IqiiqII")
SLOT_BYTES = 64 * 1024  # a record: the header and this rank's RNG states


class BoundaryRecord:
    """This rank's RNG states at every step boundary, in its node's memory directory:
    slot ``step % 2`` of ``boundary/rank<r>`` (a rank killed while writing one slot
    leaves the other intact), and the version counters of the tensors a snapshot holds.

    The attempt (world size, restart count, resumed-from step) is in every record, so
    a record left by an earlier attempt never passes for this one's."""

    def __init__(self, directory: Path, rank: int, attempt: tuple[int, int, int],
                 tensors: Callable[[], list[torch.Tensor]]) -> None:
        private_dir(directory, "the rescue's boundary directory")
        self.directory = directory
        self.path = directory / f"rank{rank}"
        self._attempt = attempt
        self._tensors = tensors
        self._watched: list[torch.Tensor] | None = None
        self._fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        self.step: int | None = None
        self._versions = 0
        self._numpy = _NumpyState()

    def capture(self, step: int, *, pre_step: bool = False) -> bytes | None:
        """This rank's record of ``step`` as it would be written now (None when the RNG
        states do not fit a slot: not expected, a slot is several times their size).
        ``pre_step``: taken before the optimizer step of ``step``, marked as such."""
        payload = _rng_bytes(self._numpy)
        if len(payload) + _HEADER.size > SLOT_BYTES:
            return None
        magic = _MAGIC_PRE_STEP if pre_step else _MAGIC
        return _HEADER.pack(magic, step, *self._attempt, len(payload),
                            zlib.crc32(payload)) + payload

    def record(self, step: int) -> bytes | None:
        """After step ``step`` completed on this rank (before anything else of it).
        Returns the record written (a peer node keeps a copy: snapshot/memory/peer_records.py),
        None when there was none to write."""
        data = self.capture(step)
        if data is not None:
            self.keep(step, data)
        return data

    def keep(self, step: int, data: bytes) -> None:
        """Write ``data``, this rank's record of ``step`` taken at its boundary, and
        watch the tensors from here on."""
        if self._watched is None:  # the tensors exist from the first step on
            self._watched = self._tensors()
        if os.pwrite(self._fd, data, (step % 2) * SLOT_BYTES) != len(data):
            # A full tmpfs can cut a write short: the record is torn (its checksum says
            # so), and this step has none.
            raise OSError(errno.ENOSPC, f"{self.path}: short write of a boundary record")
        self.step = step
        self._versions = self._version_sum()

    def unchanged(self) -> bool:
        """No tensor a snapshot holds changed since the last record (an in-place update
        moves a version counter; counters only grow, so the sum says it)."""
        return self._watched is not None and self._version_sum() == self._versions

    def _version_sum(self) -> int:
        assert self._watched is not None
        return sum(t._version for t in self._watched)

    def close(self) -> None:
        os.close(self._fd)


def write_peer_record(fd: int, data: bytes) -> int | None:
    """Keep a record another node's rank wrote (its bytes, as sent) in its slot of the
    open file ``fd``; returns its step, or None when ``data`` is no record (it is then
    not written). Only the header is looked at: the reader checks the rest."""
    if len(data) < _HEADER.size:
        return None
    magic, step, *_ = _HEADER.unpack_from(data)
    if magic not in (_MAGIC, _MAGIC_PRE_STEP) or step < 0:
        return None
    if os.pwrite(fd, data, (step % 2) * SLOT_BYTES) != len(data):
        raise OSError(errno.ENOSPC, "short write of a peer's boundary record")
    return int(step)


def record_length(data: bytes | memoryview) -> int:
    """The length of the record at the start of ``data`` (0 when it is none)."""
    if len(data) < _HEADER.size:
        return 0
    magic, _, _, _, _, length, _ = _HEADER.unpack_from(data)
    return _HEADER.size + length if magic in (_MAGIC, _MAGIC_PRE_STEP) else 0


def record_step(data: bytes | memoryview) -> int | None:
    """The step of the record at the start of ``data`` (None when it is none)."""
    if record_length(data) == 0:
        return None
    return int(_HEADER.unpack_from(data)[1])


def same_states(record: bytes, other: bytes) -> bool:
    """Whether two records of one step hold the same RNG states (whatever their kind)."""
    return record[4:] == other[4:]  # all but the magic


def read_record(directory: Path, rank: int, step: int, attempt: tuple[int, int, int],
                *, pre_step_ok: bool = False) -> dict[str, Any] | None:
    """Rank ``rank``'s RNG states at ``step`` of this attempt (None when its node's
    record of that step is missing, torn or from another attempt, or was taken before
    the optimizer step and ``pre_step_ok`` is False)."""
    try:
        raw = (directory / f"rank{rank}").read_bytes()
    except OSError:
        return None
    offset = (step % 2) * SLOT_BYTES
    head = raw[offset:offset + _HEADER.size]
    if len(head) < _HEADER.size:
        return None
    magic, got_step, world, restarts, resumed, length, crc = _HEADER.unpack(head)
    payload = raw[offset + _HEADER.size:offset + _HEADER.size + length]
    kinds = (_MAGIC, _MAGIC_PRE_STEP) if pre_step_ok else (_MAGIC,)
    if (magic not in kinds or got_step != step or (world, restarts, resumed) != attempt
            or len(payload) != length or zlib.crc32(payload) != crc):
        return None
    return _rng_state(payload)


def _rng_bytes(numpy_state: _NumpyState) -> bytes:
    """This process's RNG states as length-prefixed byte strings (no pickle: a record
    is read back by another process)."""
    version, internal, gauss = random.getstate()
    parts = [struct.pack("<iBd", version, gauss is not None, gauss or 0.0),
             struct.pack(f"<{len(internal)}Q", *internal),
             tensor_bytes(torch.get_rng_state()).tobytes()]
    parts += numpy_state.parts()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts += [tensor_bytes(s).tobytes() for s in torch.cuda.get_rng_state_all()]
    return b"".join(struct.pack("<I", len(part)) + part for part in parts)


class _NumpyState:
    """numpy's global (legacy) RNG state as record parts, without ``get_state()`` when
    it cannot have changed: a look at the generator's state through its ctypes address
    is far cheaper (docs/memory-tier.md#rescue). A pending cached gaussian can be used up without
    moving that state, so a look is trusted only after a capture that had none; and
    only once a capture showed the look reads exactly the keys and position."""

    _LOOK_BYTES = 624 * 4 + 4  # MT19937: key[624] (uint32), then pos (int32)

    def __init__(self) -> None:
        self._address: int | None = None
        if np is not None:
            with contextlib.suppress(Exception):  # a numpy without it: always get_state
                generator = np.random.mtrand._rand._bit_generator
                self._address = int(generator.ctypes.state_address)
        self._seen: bytes | None = None
        self._parts: list[bytes] = []

    def parts(self) -> list[bytes]:
        if np is None:  # pragma: no cover
            return [b"", b"", b""]
        look = (ctypes.string_at(self._address, self._LOOK_BYTES)
                if self._address is not None else None)
        if look is not None and look == self._seen:
            return self._parts
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        key_bytes = np.asarray(keys, dtype=np.uint32).tobytes()
        self._parts = [name.encode(), struct.pack("<iid", int(pos), int(has_gauss),
                                                  float(cached)), key_bytes]
        exact = look == key_bytes + struct.pack("<i", int(pos))
        self._seen = look if exact and not has_gauss else None
        return self._parts


def _rng_state(payload: bytes) -> dict[str, Any]:
    """``_rng_bytes`` as :func:`elastictrain.snapshot.state.rng.capture_rng` returns it."""
    parts: list[bytes] = []
    offset = 0
    while offset < len(payload):
        (length,) = struct.unpack_from("<I", payload, offset)
        parts.append(payload[offset + 4:offset + 4 + length])
        offset += 4 + length
    head, internal, cpu, name, numpy_meta, keys, *cuda = parts
    version, has_gauss_py, gauss = struct.unpack("<iBd", head)
    words = struct.unpack(f"<{len(internal) // 8}Q", internal)
    state: dict[str, Any] = {
        "python": (version, torch.tensor(words, dtype=torch.int64),
                   gauss if has_gauss_py else None),
        "torch": torch.frombuffer(bytearray(cpu), dtype=torch.uint8),
    }
    if name:
        pos, has_gauss, cached = struct.unpack("<iid", numpy_meta)
        words64 = torch.frombuffer(bytearray(keys), dtype=torch.int32).to(torch.int64)
        state["numpy"] = (name.decode(), words64 & 0xFFFFFFFF, pos, has_gauss, cached)
    if cuda:
        state["cuda"] = [torch.frombuffer(bytearray(c), dtype=torch.uint8) for c in cuda]
    return state


def mark_rescued(directory: Path, step: int) -> None:
    """Note that the memory snapshot of ``step`` is a rescue (the restart that resumes
    it says so in its ``resume`` event; the automatic memory interval reads that)."""
    os.close(open_private(directory / f"{_RESCUED}{step}", os.O_WRONLY | os.O_CREAT))


def was_rescued(directory: Path, step: int) -> bool:
    return (directory / f"{_RESCUED}{step}").exists()


def clear_marks(directory: Path) -> None:
    """Forget earlier rescues (after every rank of a restart has read its mark)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(_RESCUED):
                (directory / name).unlink(missing_ok=True)


def marks_dir(boundary: Path) -> Path:
    """Where this process marks a rescue in progress: the launcher's directory when it
    named one (``MARKS_ENV``), else the boundary directory."""
    return launcher_marks_dir() or boundary


@contextlib.contextmanager
def rescuing(directory: Path) -> Iterator[None]:
    """Mark this process as writing a rescue while the block runs. Entered before the
    rescue takes its lock or waits for anything: from the moment one may begin, the
    agent sees it (and waits up to ``launch.rescue_timeout_s``)."""
    marker = directory / f"{RESCUING}{os.getpid()}"
    private_dir(directory, "the rescue's marks")
    os.close(open_private(marker, os.O_WRONLY | os.O_CREAT))
    try:
        yield
    finally:
        marker.unlink(missing_ok=True)


_held_locks: list[int] = []  # open until the process ends: one rescue per step


def take_lock(directory: Path, attempt: tuple[int, int, int], step: int) -> bool:
    """True for the one rank of this node that rescues ``step`` of this attempt. An
    ``flock``, held until this process ends: a rescuer killed half-way leaves no lock
    behind that would stop another rank."""
    world, restarts, resumed = attempt
    fd = open_private(directory / f"rescue-{world}-{restarts}-{resumed}-{step}",
                      os.O_WRONLY | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _held_locks.append(fd)
    return True


# The rescue of this process's manager: run by elastictrain's excepthook
# (runtime.exit_on_error) on an uncaught error. A weak reference: a manager the
# script dropped is not kept alive by it.
_armed: weakref.ref[Callable[[BaseException], None]] | None = None
_armed_mark: Path | None = None


def arm(rescue: Callable[[BaseException], None]) -> None:
    """Run ``rescue`` on an uncaught error. Under a launcher that waits for rescues
    (``MARKS_ENV``) this process is also marked armed there: the agent then gives it a
    moment to begin its rescue before it stops the group (``agent.py``)."""
    global _armed, _armed_mark
    _armed = weakref.WeakMethod(rescue) if hasattr(rescue, "__self__") else weakref.ref(rescue)
    named = launcher_marks_dir()
    if named is not None and _armed_mark is None:
        mark = named / f"{ARMED}{os.getpid()}"
        private_dir(mark.parent, "the rescue's marks")
        os.close(open_private(mark, os.O_WRONLY | os.O_CREAT))
        _armed_mark = mark


def disarm() -> None:
    global _armed, _armed_mark
    _armed = None
    if _armed_mark is not None:
        _armed_mark.unlink(missing_ok=True)
        _armed_mark = None


def on_uncaught(exc: BaseException) -> None:
    """Run the armed rescue once, for an error (never raises: the error that ended the
    worker is what its log must show). An exit (``SystemExit``: a preemption's exit 75
    included, after its final snapshot) or Ctrl-C is no failure to rescue from. The
    armed mark goes only once the rescue is over: by then its ``rescuing-`` marker has
    come and gone, so the agent never sees this process as neither."""
    global _armed
    rescue = _armed() if _armed is not None and isinstance(exc, Exception) else None
    _armed = None
    try:
        if rescue is None:
            return
        started = time.perf_counter()
        try:
            rescue(exc)
        except Exception as failure:  # a rescue must never mask the error
            log.warning("snapshot.rescue_skipped",
                        reason=f"{type(failure).__name__}: {failure}",
                        duration_s=round(time.perf_counter() - started, 4))
    finally:
        disarm()
