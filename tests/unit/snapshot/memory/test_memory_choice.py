"""Which memory snapshot the ranks restore (snapshot/memory/memory_choice.py): a table of what
the nodes hold against the choice, in one process. A snapshot is (step, attempt,
identity); two copies of one snapshot share all three."""

from __future__ import annotations

import pytest

from elastictrain.snapshot.memory.memory_choice import NO_STEP, Choice, Durable, Held, choose

NONE = Held()


def h(step: int, attempt: int = 1, identity: str = "") -> Held:
    """A snapshot of ``step`` from ``attempt``; the identity defaults to one per pair."""
    return Held(step, attempt, identity or f"s{step}a{attempt}")


D5 = Durable(5, 1)
ALL = [True] * 5


@pytest.mark.parametrize(("held", "receive", "durable", "expected"), [
    # every node holds 7: memory, nothing to copy
    ([h(7), h(7)], ALL[:2], D5, Choice(7, None, {})),
    # a replaced node holds nothing: node 0 sends it 7
    ([h(7), NONE], ALL[:2], D5, Choice(7, None, {1: 0})),
    # a node whose last write was lost: the newest wins, sent to the older one
    ([h(7), h(8)], ALL[:2], D5, Choice(8, None, {0: 1})),
    # holders take turns: two holders, three lacking nodes
    ([h(9), NONE, h(9), h(4), NONE], ALL, D5, Choice(9, None, {1: 0, 3: 2, 4: 0})),
    # no durable snapshot yet
    ([h(7), NONE], ALL[:2], Durable(), Choice(7, None, {1: 0})),
    ([NONE, NONE], ALL[:2], D5, Choice(NO_STEP, "no memory snapshot", {})),
    ([h(7), NONE], ALL[:2], Durable(7, 1),
     Choice(NO_STEP, "not newer than the durable snapshot", {})),
    ([h(6), h(7)], ALL[:2], Durable(9, 1),
     Choice(NO_STEP, "not newer than the durable snapshot", {})),
    # a node lacking it has no memory directory (a full tmpfs): durable
    ([h(7), NONE], [True, False], D5,
     Choice(NO_STEP, "node(s) [1] lack step 7 and have no memory directory to receive it", {})),
    # one that holds it needs none
    ([h(7), h(7)], [True, False], D5, Choice(7, None, {})),
    # -- a node back with its memory from an attempt the job went on without --
    # the same step from an earlier attempt (a timeline the job left): replaced by the
    # newest attempt's copy
    ([h(13, 3), h(13, 2)], ALL[:2], D5, Choice(13, None, {1: 0})),
    ([h(13, 2), h(13, 3), h(13, 3)], ALL[:3], D5, Choice(13, None, {0: 1})),
    # a higher step from an earlier attempt loses to the newest attempt's snapshot
    ([h(13, 3), h(16, 2)], ALL[:2], D5, Choice(13, None, {1: 0})),
    # an earlier attempt's snapshot older than the durable one's attempt never counts
    ([h(16, 2), NONE], ALL[:2], Durable(14, 3),
     Choice(NO_STEP, "not newer than the durable snapshot", {})),
    ([h(16, 2), h(15, 3)], ALL[:2], Durable(14, 3), Choice(15, None, {0: 1})),
    # two different snapshots of one step from one attempt: neither, never each its own
    ([h(13, 3, "x"), h(13, 3, "y")], ALL[:2], D5,
     Choice(NO_STEP, "the nodes hold 2 different snapshots of step 13 from attempt 3", {})),
    # ... also where a newer attempt's other step is not in the way
    ([h(13, 3, "x"), h(13, 3, "y"), h(12, 3)], ALL[:3], D5,
     Choice(NO_STEP, "the nodes hold 2 different snapshots of step 13 from attempt 3", {})),
])
def test_choose(held: list[Held], receive: list[bool], durable: Durable,
                expected: Choice) -> None:
    assert choose(held, receive, durable) == expected


def test_without_copies_every_node_must_hold_the_same_snapshot() -> None:
    assert choose([h(7), h(7)], [False, False], D5, may_transfer=False) == Choice(7, None, {})
    for held in ([h(7), NONE], [h(8), h(7)], [h(13, 3), h(13, 2)]):
        choice = choose(held, [True, True], D5, may_transfer=False)
        assert choice.step == NO_STEP
        assert choice.reason is not None and "no copy may cross nodes" in choice.reason
    assert choose([NONE, NONE], [True, True], D5, may_transfer=False).reason == \
        "no memory snapshot"


def test_manifest_identity_ignores_when_a_copy_was_written() -> None:
    from elastictrain.snapshot.format.manifest import Manifest, ObjectEntry

    def manifest(created: str, checksum: str = "ab", attempt: int | None = 2) -> Manifest:
        return Manifest(run_id="r", step=3, epoch=0, world_size=2, created_at=created,
                        torch_version="t", elastictrain_version="e", checksum_algorithm="crc32",
                        objects=[ObjectEntry(name="payload.pt", size_bytes=4,
                                             checksum=checksum)], attempt=attempt)

    one, copy = manifest("2026-01-01"), manifest("2026-01-02")
    assert one.identity() == copy.identity()
    assert one.identity() != manifest("2026-01-01", checksum="cd").identity()
    assert one.identity() != manifest("2026-01-01", attempt=3).identity()
    assert Held.of(one) == Held.of(copy) == Held(3, 2, one.identity())
    # A manifest written before attempts were recorded reads and hashes as it did.
    old = manifest("2026-01-01", attempt=None)
    assert b"attempt" not in old.to_json() and b"attempt" not in old.canonical_json()
    assert Held.of(old).attempt == -1
