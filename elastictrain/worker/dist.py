"""Process-group lifecycle and the few collectives elastictrain needs.

The only module that sets up ``torch.distributed``. Under torchrun every
restart is a fresh process that must rejoin cleanly: we initialise from the
torchrun environment with a deadline (a hung ``init_process_group`` is
invisible to the agent, so we exit and let torchrun restart us), warn when
the agent shares its rendezvous store across attempts (torch 2.13 + gloo:
restarted workers read stale addresses), and destroy the group on exit.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

from elastictrain.core.config import DistConfig
from elastictrain.core.env import SHARE_STORE_FIX_VAR, WorkerEnv
from elastictrain.core.errors import EXIT_HANG, ConfigError
from elastictrain.core.log import get_logger

log = get_logger("elastictrain.dist")

# Tensors elastictrain handed to collectives, kept until the backend's worker threads
# let go of them. A gloo worker thread drops a finished work's tensors after the caller
# saw the result, and with torch >= 2.10 that always takes the GIL (the tensor's Python
# object is released from C++). If the main thread meanwhile holds the GIL while
# ~ProcessGroupGloo joins that thread (interpreter exit, a DDP model freed after
# destroy_process_group), the process hangs. So each collective below returns only once
# the backend let go of its tensors (`_released`, GIL released while it waits). See docs/faults.md.
_handed: deque[torch.Tensor] = deque(maxlen=256)
QUIESCE_TIMEOUT_S = 5.0


@dataclass
class DistContext:
    """This worker's process group: rank, world size, backend and device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    initialized: bool

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    # -- small collectives (no-ops in a single process) ---------------------------
    def barrier(self) -> None:
        if self.initialized:
            torch_dist.barrier()

    def all_reduce_max(self, values: list[int], timeout_s: float | None = None) -> list[int]:
        """Element-wise max of small integer vectors across ranks; with ``timeout_s``,
        raises when the others do not all take part within that time."""
        if not self.initialized:
            return list(values)
        tensor = _kept(torch.tensor(values, dtype=torch.int64, device=self._comm_device))
        if timeout_s is None:
            torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
        else:
            work = torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX, async_op=True)
            assert work is not None  # async_op=True returns the work
            work.wait(timeout=timedelta(seconds=timeout_s))
            del work  # the work object pins the tensor too
        _released([tensor])
        return [int(v) for v in tensor.tolist()]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s object on every rank (pickled over the group, never from storage:
        the peers of a process group are trusted as by torch's own object collectives)."""
        if not self.initialized:
            return obj
        size = _kept(torch.zeros(1, dtype=torch.int64, device=self._comm_device))
        data = _pickled(obj, self._comm_device) if self.rank == src else None
        if data is not None:
            size.fill_(data.numel())
        torch_dist.broadcast(size, src=src)
        if data is None:
            data = _kept(torch.empty(int(size.item()), dtype=torch.uint8,
                                     device=self._comm_device))
        torch_dist.broadcast(data, src=src)
        _released([size, data])
        return obj if self.rank == src else _unpickled(data)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order, on every rank."""
        if not self.initialized:
            return [obj]
        data = _pickled(obj, self._comm_device)
        size = _kept(torch.tensor([data.numel()], dtype=torch.int64, device=self._comm_device))
        sizes = [_kept(torch.zeros_like(size)) for _ in range(self.world_size)]
        torch_dist.all_gather(sizes, size)
        longest = max(int(s.item()) for s in sizes)
        padded = _kept(torch.zeros(longest, dtype=torch.uint8, device=self._comm_device))
        padded[:data.numel()] = data
        out = [_kept(torch.empty_like(padded)) for _ in range(self.world_size)]
        torch_dist.all_gather(out, padded)
        _released([data, size, padded, *sizes, *out])
        return [_unpickled(o[:int(n.item())]) for o, n in zip(out, sizes, strict=True)]

    def gather_object(self, obj: Any, dst: int = 0, agree: Sequence[int] = ()
                      ) -> tuple[list[Any] | None, list[int]]:
        """Every rank's object, in rank order, on rank ``dst`` only (None elsewhere),
        and the element-wise max of ``agree`` on every rank.

        What only one rank needs (the RNG states the writer saves): each other rank
        sends its object and receives nothing, where ``all_gather_object`` hands every
        rank all N objects (N² in all). One all-reduce sizes the gather and carries
        ``agree`` (a decision every rank must share), so it costs no collective more.
        """
        if not self.initialized:
            return [obj], list(agree)
        data = _pickled(obj, self._comm_device)
        longest, *agreed = self.all_reduce_max([data.numel(), *agree])
        # Each object travels as [its length as 8 bytes | its bytes | padding].
        padded = _kept(torch.zeros(longest + 8, dtype=torch.uint8, device=self._comm_device))
        padded[:8] = torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8)
        padded[8:8 + data.numel()] = data
        out = ([_kept(torch.empty_like(padded)) for _ in range(self.world_size)]
               if self.rank == dst else None)
        torch_dist.gather(padded, out, dst=dst)
        _released([data, padded, *(out or [])])
        if out is None:
            return None, agreed
        lengths = [int(o[:8].cpu().view(torch.int64).item()) for o in out]
        return [_unpickled(o[8:8 + n]) for o, n in zip(out, lengths, strict=True)], agreed

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        """``objs[r]`` (a list on rank ``src``, one object per rank) on each rank ``r``:
        what each rank needs of its own, where a broadcast would send every rank all N."""
        if not self.initialized:
            assert objs is not None
            return objs[0]
        pickled = ([_pickled(o, torch.device("cpu")) for o in objs]
                   if self.rank == src and objs is not None else [])
        longest = self.all_reduce_max([max((p.numel() for p in pickled), default=0)])[0]
        out = _kept(torch.empty(longest + 8, dtype=torch.uint8, device=self._comm_device))
        parts = None
        if pickled:
            parts = []
            for data in pickled:  # [its length as 8 bytes | its bytes | padding]
                padded = torch.zeros(longest + 8, dtype=torch.uint8)
                padded[:8] = torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8)
                padded[8:8 + data.numel()] = data
                parts.append(_kept(padded.to(self._comm_device)))
        torch_dist.scatter(out, parts, src=src)
        _released([out, *(parts or [])])
        length = int(out[:8].cpu().view(torch.int64).item())
        return _unpickled(out[8:8 + length])

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0,
                         chunk_bytes: int = 256 << 20) -> None:
        """Overwrite a contiguous CPU ``tensor`` on every rank with rank ``src``'s, in
        place, in chunks (bounded memory on the comm device, no giant messages)."""
        if not self.initialized:
            return
        flat = tensor.view(-1).view(torch.uint8)
        for start in range(0, flat.numel(), chunk_bytes):
            chunk = flat[start:start + chunk_bytes]  # not kept: it pins the caller's tensor
            if self._comm_device.type == "cpu":
                torch_dist.broadcast(chunk, src=src)
            else:
                on_device = chunk.to(self._comm_device)
                torch_dist.broadcast(on_device, src=src)
                chunk.copy_(on_device)

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")


def warn_about_the_launch(env: WorkerEnv) -> str | None:
    """Under plain torchrun, warn of a launch whose restarts are unreliable with gloo
    (docs/guide.md#torchrun-restarts-torch-213-with-gloo); returns the event logged."""
    if not env.under_torchrun:
        return None
    if env.agent_store_shared:
        log.warning(
            "dist.store_shared",
            fix=f"export {SHARE_STORE_FIX_VAR}=1 before torchrun (elastictrain run sets it)",
            why="torch>=2.4 agents share one store across restart attempts; restarted gloo "
            "workers can read stale addresses and hang in init_process_group")
        return "dist.store_shared"
    if env.uses_agent_store and env.max_restarts > 0:
        log.warning(
            "dist.static_rendezvous",
            fix="torchrun --standalone ... on one node, --rdzv-backend=c10d "
            "--rdzv-endpoint=HOST:PORT across nodes, or elastictrain run",
            why="torchrun's default static rendezvous keeps its store across restart "
            "attempts: restarted gloo workers can connect to the previous attempt's "
            "addresses (Connection refused) and use up the restarts")
        return "dist.static_rendezvous"
    return None


def init_process_group(cfg: DistConfig | None = None, env: WorkerEnv | None = None) -> DistContext:
    """Join the process group described by the torchrun environment.

    Picks NCCL when CUDA is available (and sets this rank's device), gloo
    otherwise. Outside torchrun with no ``MASTER_ADDR`` it returns a
    single-process context without a group.

    Raises nothing on a hang: if the group is not formed within
    ``cfg.init_timeout_s`` the process logs ``dist.init_timeout`` and exits
    with a non-zero code so torchrun restarts the workers.
    """
    cfg = cfg or DistConfig()
    env = env or WorkerEnv.from_environ()
    backend = _choose_backend(cfg.backend)
    device = _choose_device(backend, env.local_rank)
    if not env.is_distributed:
        return DistContext(env.rank, env.world_size, env.local_rank, backend, device, False)
    warn_about_the_launch(env)
    with deadline(cfg.init_timeout_s, "dist.init_timeout"):
        torch_dist.init_process_group(
            backend=backend,
            init_method="env://",
            timeout=timedelta(seconds=cfg.collective_timeout_s),
            device_id=device if backend == "nccl" else None,
        )
        ctx = DistContext(torch_dist.get_rank(), torch_dist.get_world_size(), env.local_rank,
                          backend, device, True)
        ctx.barrier()  # the group is usable only once every rank has connected
    log.info("rendezvous.joined", backend=backend, device=str(device))
    return ctx


def find_context(env: WorkerEnv) -> DistContext:
    """The process group someone else initialised, else a single process.

    Raises:
        ConfigError: the environment says several ranks (``WORLD_SIZE`` > 1) but no
            group is initialised: every rank would act alone.
    """
    if torch_dist.is_available() and torch_dist.is_initialized():
        backend = str(torch_dist.get_backend())
        device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                  else torch.device("cpu"))
        return DistContext(torch_dist.get_rank(), torch_dist.get_world_size(), env.local_rank,
                           backend, device, True)
    if env.world_size > 1:
        raise ConfigError(
            f"WORLD_SIZE={env.world_size} but no process group is initialised, so every rank "
            "would snapshot alone; fix: call elastictrain.init() first (or pass ctx=)")
    return DistContext(env.rank, env.world_size, env.local_rank, "gloo", torch.device("cpu"),
                       False)


def destroy_process_group() -> None:
    """Tear the group down (safe to call when none exists)."""
    quiesce()
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def quiesce(timeout_s: float = QUIESCE_TIMEOUT_S) -> None:
    """Wait, with the GIL released, until the backend let go of every tensor
    elastictrain handed it; then drop them. One still held at the deadline stays
    referenced (a small leak at exit beats a hang)."""
    _released(list(_handed), timeout_s)
    held = [t for t in _handed if _held(t)]
    _handed.clear()
    _handed.extend(held)


def _released(tensors: list[torch.Tensor], timeout_s: float = QUIESCE_TIMEOUT_S) -> None:
    """Wait, with the GIL released, until the backend let go of ``tensors`` (after a
    collective, usually within one GIL switch); at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(map(_held, tensors)) and time.monotonic() < deadline:
        time.sleep(0.0002)  # a worker thread waiting for the GIL gets it here


def _held(tensor: torch.Tensor) -> bool:
    """Whether C++ (a pending work) still references ``tensor`` besides Python."""
    return int(tensor._use_count()) > 1  # type: ignore[attr-defined]


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    _handed.append(tensor)
    return tensor


def _pickled(obj: Any, device: torch.device) -> torch.Tensor:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    return _kept(data.to(device))


def _unpickled(data: torch.Tensor) -> Any:
    # The bytes straight from the tensor's memory, not through a list of Python ints:
    # this runs once per rank on every snapshot's RNG gather (docs/performance.md).
    cpu = data.cpu().contiguous()
    return pickle.loads(ctypes.string_at(cpu.data_ptr(), cpu.numel()))


def _choose_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def _choose_device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class deadline:
    """Exit the process if a block does not finish in time (hangs become restarts)."""

    def __init__(self, seconds: float, event: str) -> None:
        self._seconds = seconds
        self._event = event
        self._timer: threading.Timer | None = None

    def __enter__(self) -> deadline:
        self._timer = threading.Timer(self._seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        log.error(self._event, timeout_s=self._seconds, exit_code=EXIT_HANG)
        os._exit(EXIT_HANG)

