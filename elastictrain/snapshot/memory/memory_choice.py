"""Which node-memory snapshot of replicated (DDP) state the ranks restore: the rule, a
pure function of what every node holds (docs/memory-tier.md#which-copy).

The ranks agree on a snapshot's identity, never on a step number alone: a node whose
memory outlived its agent can come back holding a snapshot of the same step from a
timeline the job has left (the job restarted without it from an older snapshot and
trained that step again, on other bits). The rule:

* a snapshot counts only when it is newer than the newest durable one, in step and in
  the job's attempt (snapshot/state/attempt.py): one taken by an attempt before the durable
  one's belongs to a timeline the durable one replaced;
* of those, the newest attempt's newest step wins: a later attempt's snapshot is the
  job's present, whatever step an earlier attempt reached;
* two different snapshots of that step from one attempt cannot be told apart: memory
  is not used (durable storage is the truth), never each node's own;
* every node not holding the chosen snapshot itself (none, another step, or another
  snapshot of the same step) receives it from a holder, when copies may cross nodes and
  it has a memory directory to receive into; otherwise memory is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastictrain.snapshot.format.manifest import Manifest

NO_STEP = -1  # a node holding no committed memory snapshot
NO_ATTEMPT = -1  # a snapshot taken before attempts were recorded (or none)


@dataclass(frozen=True)
class Held:
    """One node's newest committed memory snapshot, as the ranks compare it."""

    step: int = NO_STEP
    attempt: int = NO_ATTEMPT
    identity: str = ""  # Manifest.identity(): equal for two copies of one snapshot

    @classmethod
    def of(cls, manifest: Manifest | None) -> Held:
        if manifest is None:
            return cls()
        return cls(manifest.step,
                   NO_ATTEMPT if manifest.attempt is None else manifest.attempt,
                   manifest.identity())

    def describe(self) -> str:
        return f"step {self.step} (attempt {self.attempt}, {self.identity[:12]})"


@dataclass(frozen=True)
class Durable:
    """The newest durable snapshot: memory must be newer than it."""

    step: int = NO_STEP
    attempt: int = NO_ATTEMPT

    @classmethod
    def of(cls, manifest: Manifest | None) -> Durable:
        if manifest is None:
            return cls()
        return cls(manifest.step, NO_ATTEMPT if manifest.attempt is None else manifest.attempt)

    def older_than(self, held: Held) -> bool:
        return held.step > self.step and held.attempt >= self.attempt


@dataclass(frozen=True)
class Choice:
    """What the ranks restore from memory: ``step`` (``NO_STEP`` with a ``reason`` not
    to), and for each node not holding it the node that sends it (``sources``)."""

    step: int
    reason: str | None
    sources: dict[int, int]


def choose(held: list[Held], can_receive: list[bool], durable: Durable,
           *, may_transfer: bool = True) -> Choice:
    """The memory snapshot every node restores (module docstring).

    Args:
        held: each node's newest committed memory snapshot (``Held()``: none).
        can_receive: each node has a memory directory to receive a copy into.
        durable: the newest durable snapshot (``Durable()``: none).
        may_transfer: copies may cross nodes (peers are connected).
    """
    if all(h.step == NO_STEP for h in held):
        return Choice(NO_STEP, "no memory snapshot", {})
    newer = [h for h in held if h.step != NO_STEP and durable.older_than(h)]
    if not newer:
        return Choice(NO_STEP, "not newer than the durable snapshot", {})
    best = max(newer, key=lambda h: (h.attempt, h.step))
    rivals = {h.identity for h in newer if (h.attempt, h.step) == (best.attempt, best.step)}
    if len(rivals) > 1:
        return Choice(NO_STEP, f"the nodes hold {len(rivals)} different snapshots of step "
                      f"{best.step} from attempt {best.attempt}", {})
    holders = [node for node, h in enumerate(held) if h == best]
    lacking = [node for node, h in enumerate(held) if h != best]
    if lacking and not may_transfer:
        other = sorted({held[node].describe() if held[node].step != NO_STEP else "none"
                        for node in lacking})
        return Choice(NO_STEP, f"not every node holds {best.describe()} (others: "
                      f"{', '.join(other)}) and no copy may cross nodes", {})
    unable = [node for node in lacking if not can_receive[node]]
    if unable:
        return Choice(NO_STEP, f"node(s) {unable} lack step {best.step} and have no memory "
                      "directory to receive it", {})
    return Choice(best.step, None, {node: holders[i % len(holders)]
                                    for i, node in enumerate(lacking)})
