"""Exactly-once data for a node trial, from the demo's per-step sample records.

The demo's workers (``--record-samples DIR``) append one line per optimizer step: the
world (one formation of the process group), rank, world size, epoch and the sample
indices it trained. A step redone after a restart is recorded again by a later world;
the execution that counts is the latest world's. The check reads what the workers say
they trained, not what the sampler meant to deal.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from elastictrain.runlog.events_read import read_events
from elastictrain.worker.data import ElasticSampler


def read_records(directory: Path) -> list[dict[str, Any]]:
    """Every record line of the trial, in time order."""
    found = [r for p in sorted(directory.glob("*.jsonl")) for r in read_events(p)]
    return sorted(found, key=lambda r: float(r["ts"]))


def surviving(records: list[dict[str, Any]]) -> tuple[dict[int, list[dict[str, Any]]], str | None]:
    """Per step, the records of the latest world that ran it; or why that execution is
    not whole (a rank missing or twice, ranks in different epochs)."""
    first_seen: dict[str, float] = {}
    runs: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        first_seen.setdefault(str(r["world"]), float(r["ts"]))
        runs[int(r["step"])][str(r["world"])].append(r)
    steps: dict[int, list[dict[str, Any]]] = {}
    for step, worlds in runs.items():
        rows = worlds[max(worlds, key=lambda w: first_seen[w])]
        size = int(rows[0]["world_size"])
        if sorted(int(r["rank"]) for r in rows) != list(range(size)):
            return steps, f"step {step}: ranks {sorted(r['rank'] for r in rows)} of {size}"
        if len({r["epoch"] for r in rows}) != 1:
            return steps, f"step {step}: ranks in different epochs"
        steps[step] = rows
    return steps, None


def check_exactly_once(directory: Path, dataset_len: int, seed: int,
                       final_step: int | None) -> str | None:
    """Steps 1..final_step each survive once, whole; every finished epoch trained each
    sample once, plus a tail padding of fewer samples than its last world size (the
    first ones of the epoch's order); the unfinished last epoch trained a prefix of
    its order, no sample twice."""
    steps, broken = surviving(read_records(directory))
    if broken:
        return f"data: {broken}"
    if final_step is None or sorted(steps) != list(range(1, final_step + 1)):
        missing = sorted(set(range(1, (final_step or 0) + 1)) - set(steps))
        return f"data: steps {missing[:10]} never trained (final step {final_step})"
    epochs: dict[int, list[int]] = defaultdict(list)
    last_world: dict[int, int] = {}
    for step in sorted(steps):
        rows = sorted(steps[step], key=lambda r: int(r["rank"]))
        epoch = int(rows[0]["epoch"])
        epochs[epoch] += [int(i) for r in rows for i in r["samples"]]
        last_world[epoch] = int(rows[0]["world_size"])
    sampler = ElasticSampler(dataset_len, 1, seed=seed)
    for epoch, trained in sorted(epochs.items()):
        order = sampler.epoch_order(epoch)
        counts = Counter(trained)
        if epoch != max(epochs):
            pad = len(trained) - dataset_len
            expected = Counter(order) + Counter(order[:max(pad, 0)])
            if counts != expected or not 0 <= pad < last_world[epoch]:
                twice = [i for i, c in counts.items() if c > expected[i]][:5]
                return (f"data: epoch {epoch} trained {len(trained)} samples for "
                        f"{dataset_len} (pad {pad}); over-trained {twice}")
        elif set(counts) != set(order[:len(trained)]) or max(counts.values()) > 1:
            twice = [i for i, c in counts.items() if c > 1][:5]
            return (f"data: the last epoch ({epoch}) is not a prefix of its order trained "
                    f"once (twice: {twice})")
    return None


def final_world_sizes(directory: Path) -> set[int]:
    """The world sizes of the surviving executions of every step."""
    steps, _ = surviving(read_records(directory))
    return {int(rows[0]["world_size"]) for rows in steps.values()}
