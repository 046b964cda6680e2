"""The demo's elastic options are checked before anything starts: one message that
names the option, the value and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.core.errors import ConfigError, ResumeMismatchError
from elastictrain.demo.multinode import Park, parse_nnodes
from elastictrain.demo.preflight import check_resumable, demo_dataset_len
from elastictrain.demo.runner import DemoOptions
from elastictrain.snapshot.durable.commit import persist_snapshot
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.storage import open_store


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"nnodes": "2:1"}, "--nnodes=2:1: expected N or MIN:MAX"),
    ({"nnodes": "x"}, "--nnodes=x"),
    ({"kill_node_at": 5}, "--kill-node-at=5 needs a job that runs one node short: "
                          "--nnodes=1; fix: --nnodes 1:2"),
    ({"nnodes": "2:2", "kill_node_at": 5}, "fix: --nnodes 1:2"),
    ({"nnodes": "1:2", "kill_node_at": 50, "add_node_at": 40}, "--add-node-at=40 must come "
                                                               "after --kill-node-at=50"),
    ({"nnodes": "1:2", "kill_node_at": 500}, "--kill-node-at=500: outside the run's steps"),
    ({"nnodes": "1:2", "kill_at": [5]}, "with --nnodes use --kill-node-at"),
    ({"nproc": 3, "global_batch_size": 2}, "--global-batch-size=2 is not reachable with "
                                           "world size 3 and per-rank batch 16"),
    ({"batch_size": 0}, "--batch-size=0: must be >= 1"),
])
def test_bad_elastic_options_are_rejected(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        DemoOptions(**kwargs).validate()  # type: ignore[arg-type]
    assert needle in str(info.value)


def test_good_elastic_options_pass() -> None:
    DemoOptions(nnodes="1:2", nproc=1, kill_node_at=6, add_node_at=10, batch_size=4,
                global_batch_size=10).validate()
    assert parse_nnodes("3") == (3, 3) and parse_nnodes("1:4") == (1, 4)


def test_samples_beyond_the_corpus_name_its_size() -> None:
    full = demo_dataset_len(None)
    with pytest.raises(ConfigError, match=rf"--samples={full + 1}: the demo corpus has {full}"):
        demo_dataset_len(full + 1)


def test_dataset_length_is_checked_against_the_newest_manifest(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    check_resumable(DemoOptions(samples=50), store)  # nothing stored yet: fine
    for step, length in ((5, 40), (10, 50)):
        persist_snapshot(store, {"x": 1}, SnapshotMeta("r", step, 0, 2, "crc32", length))
    check_resumable(DemoOptions(samples=50), store)
    with pytest.raises(ResumeMismatchError, match=r"has 40 samples but the newest snapshot .* "
                                                  r"\(step 10\) was taken with 50; fix: "
                                                  r"resume with --samples=50"):
        check_resumable(DemoOptions(samples=40), store)


def test_park_specs_round_trip() -> None:
    park = Park("start", None, 1, 0, 0)
    assert Park.parse(park.to_arg().removeprefix("--park=")) == park
    kill = Park("kill", 6, 2, 0, None)
    assert Park.parse(kill.to_arg().removeprefix("--park=")) == kill
    assert kill.applies(6, 2, 5) and not kill.applies(6, 1, 0) and not kill.applies(7, 2, 0)
    assert park.applies(None, 1, 0) and not park.applies(None, 1, 1)
