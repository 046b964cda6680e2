"""torchrun's exit barrier, without waiting for a node that is gone.

When its workers end, an agent waits in torchrun's exit barrier until every agent of the
round arrived, so that no agent (the rendezvous store's host among them) leaves while
another node's workers still run. A node lost after the run's agreed end never arrives:
torchrun's barrier then holds every survivor for its whole timeout (300 s), and a
replacement node waits in the rendezvous as long.

:func:`exit_barrier` arrives on the same store keys as torchrun's barrier, so agents of
either kind count each other, and stops waiting once every agent still alive has
arrived. Alive means still a participant of the rendezvous round by the rendezvous's
own rule: a node whose keep-alive is older than ``keep_alive_interval`` times
``keep_alive_max_attempt`` is dropped (2 s times 3 with ``launch.rdzv_conf``'s defaults).
An agent declared dead too early costs nothing: it had not arrived, so it passes the
barrier alone once it does (the count it waits for is complete by then).

A node that joins as the job ends (the lost node's replacement) waits for a round that
never forms. The agents that finished record it in the rendezvous store
(:func:`mark_job_finished`), and each launcher stays while such a node waits
(:func:`stay_for_waiting_nodes`), so that node reads the closed rendezvous and the
record and ends with the job's success (:func:`job_finished`). A node that read them says
so (:func:`record_read_closed`): its entry in the rendezvous's wait list outlives it
until its keep-alive expires, and the launchers that stay for it need not wait that out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed import DistStoreError

from elastictrain.launcher import torch_hooks

# torchrun's own keys (torch.distributed.elastic.agent.server.api and utils.store): the
# barrier is shared with agents that run torchrun's own implementation.
TERMINAL_STATE_PREFIX = "torchelastic/agent/terminal_state"
ARRIVED_KEY = TERMINAL_STATE_PREFIX + "/num_members"
ALL_ARRIVED_KEY = TERMINAL_STATE_PREFIX + "/last_member"

POLL_S = 0.1  # how often the store is asked whether every agent arrived
LIVENESS_EVERY_S = 1.0  # how often the rendezvous state is read for who is alive


@dataclass(frozen=True)
class BarrierOutcome:
    """How the wait ended: ``all`` arrived, or ``gone``: every live agent arrived and
    ``group_world_size - live`` agents of the round left the rendezvous without."""

    ended: str
    arrived: int
    live: int | None
    waited_s: float


def exit_barrier(store: Any, group_world_size: int, timeout_s: float,
                 live_agents: Callable[[], int | None]) -> BarrierOutcome:
    """Arrive, then wait until every agent arrived or every live one did (``live_agents``
    says how many are alive, None when it cannot tell). Raises ``DistStoreError`` after
    ``timeout_s``, as torchrun's barrier does, and whatever the store raises once its
    host is gone (the host left: nobody is waiting on it any longer)."""
    started = time.monotonic()
    arrived = store.add(ARRIVED_KEY, 1)
    if arrived == group_world_size:
        store.set(ALL_ARRIVED_KEY, "<val_ignored>")
    checked = started
    while True:
        if store.check([ALL_ARRIVED_KEY]):
            return BarrierOutcome("all", group_world_size, None, time.monotonic() - started)
        now = time.monotonic()
        if now - checked >= LIVENESS_EVERY_S:
            checked = now
            live = live_agents()
            arrived = store.add(ARRIVED_KEY, 0)
            if live is not None and live < group_world_size and arrived >= live:
                return BarrierOutcome("gone", arrived, live, now - started)
        if now - started > timeout_s:
            raise DistStoreError(f"exit barrier: {store.add(ARRIVED_KEY, 0)} of "
                                 f"{group_world_size} agents arrived in {timeout_s:.0f} s")
        time.sleep(POLL_S)


def rendezvous_participants(rdzv_handler: Any) -> int | None:
    """How many nodes the rendezvous's current round holds after dropping those whose
    keep-alive expired; None for a rendezvous other than torchrun's dynamic one."""
    state = _read_state(rdzv_handler)
    return None if state is None else len(state.participants)


def nodes_waiting(rdzv_handler: Any) -> int:
    """Live nodes waiting in the rendezvous for a round that has not formed (a
    replacement started near the end of the job) and that have not yet read that it
    closed (:func:`record_read_closed`); 0 when it cannot tell."""
    state = _read_state(rdzv_handler)
    if state is None:
        return 0
    store = torch_hooks.handler_store(rdzv_handler)
    waiting = [*state.wait_list, *state.redundancy_list]
    if store is None:
        return len(waiting)
    return sum(1 for node in waiting
               if not store.check([_read_closed_key(rdzv_handler, node)]))


def record_read_closed(rdzv_handler: Any) -> None:
    """Record in the rendezvous store that this node read the closed rendezvous and
    leaves: the launchers staying for it (:func:`stay_for_waiting_nodes`) go at once."""
    store = torch_hooks.handler_store(rdzv_handler)
    node = torch_hooks.this_node(rdzv_handler)
    if store is not None and node is not None:
        store.set(_read_closed_key(rdzv_handler, node), "1")


def stay_for_waiting_nodes(rdzv_handler: Any, timeout_s: float) -> float:
    """Keep this launcher (and the rendezvous store it may host) up until no live node
    waits in the rendezvous, at most ``timeout_s``: a node that joins as the job ends
    then reads that the rendezvous closed and that the job finished (:func:`job_finished`)
    instead of losing the store mid-join. Returns the seconds it stayed."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if not nodes_waiting(rdzv_handler):
                break
        except Exception:  # the store's host is gone: nothing left to keep up
            break
        time.sleep(LIVENESS_EVERY_S)
    return time.monotonic() - started


def mark_job_finished(rdzv_handler: Any) -> None:
    """Record in the rendezvous store, beside the rendezvous state and for every round,
    that this job's workers finished the run."""
    store = torch_hooks.handler_store(rdzv_handler)
    if store is not None:
        store.set(_finished_key(rdzv_handler), "1")


def job_finished(rdzv_handler: Any) -> bool:
    """Whether an agent of this job recorded that the run finished (False when the store
    cannot tell: not the dynamic rendezvous, or unreachable)."""
    store = torch_hooks.handler_store(rdzv_handler)
    try:
        return store is not None and bool(store.check([_finished_key(rdzv_handler)]))
    except Exception:  # the store's host is gone
        return False


def _finished_key(rdzv_handler: Any) -> str:
    return f"elastictrain.finished.{rdzv_handler.get_run_id()}"


def _read_closed_key(rdzv_handler: Any, node: Any) -> str:
    # A node of torch's rendezvous is (address, pid, local id): unique while it lives.
    return (f"elastictrain.read_closed.{rdzv_handler.get_run_id()}."
            f"{node.addr}_{node.pid}_{node.local_id}")


def _read_state(rdzv_handler: Any) -> Any:
    """The rendezvous state read from its backend, dead nodes dropped, nothing written;
    None for a rendezvous other than torchrun's dynamic one (c10d, etcd-v2, file)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _BackendRendezvousStateHolder,
    )

    holder = getattr(rdzv_handler, "_state_holder", None)
    backend = getattr(holder, "_backend", None)
    settings = getattr(rdzv_handler, "_settings", None)
    if backend is None or settings is None:
        return None
    # A holder of our own: its sync reads the state and drops dead nodes in memory only
    # (it writes back only once marked dirty, which nothing here does).
    reader = _BackendRendezvousStateHolder(backend, settings, cache_duration=0)
    reader.sync()
    return reader.state
