"""Checks ``elastictrain demo`` makes before any worker starts: elastic options, the
global batch at every world size the job can take, and the dataset length against
the newest snapshot already in storage. Each failure is one line naming the
option, the numbers and the fix."""

from __future__ import annotations

from typing import Protocol

from elastictrain.core.errors import ConfigError, ResumeMismatchError
from elastictrain.demo.multinode import parse_nnodes
from elastictrain.demo.windows import corpus_windows
from elastictrain.snapshot.format.manifest import Manifest
from elastictrain.snapshot.format.reader import newest_first
from elastictrain.storage import Store
from elastictrain.worker.batching import check_global_batch


class ElasticOptions(Protocol):
    """The demo options these checks read (``DemoOptions`` has them)."""

    nproc: int
    steps: int
    kill_at: list[int]
    nnodes: str
    kill_node_at: int | None
    add_node_at: int | None
    batch_size: int
    global_batch_size: int | None
    samples: int | None


def validate_elastic(opts: ElasticOptions) -> None:
    """Option rules of the elastic features (no storage or workers needed)."""
    lo, hi = parse_nnodes(opts.nnodes)
    if opts.batch_size < 1:
        raise ConfigError(f"--batch-size={opts.batch_size}: must be >= 1")
    for name, step in (("--kill-node-at", opts.kill_node_at), ("--add-node-at", opts.add_node_at)):
        if step is not None and not 1 <= step < opts.steps:
            raise ConfigError(f"{name}={step}: outside the run's steps 1..{opts.steps - 1}; "
                              f"fix: choose a step below --steps={opts.steps}")
        if step is not None and (hi < 2 or lo > hi - 1):
            raise ConfigError(f"{name}={step} needs a job that runs one node short: "
                              f"--nnodes={opts.nnodes}; fix: --nnodes {hi - 1 or 1}:{max(hi, 2)}")
    if opts.kill_node_at is not None and opts.add_node_at is not None \
            and opts.add_node_at <= opts.kill_node_at:
        raise ConfigError(f"--add-node-at={opts.add_node_at} must come after --kill-node-at="
                          f"{opts.kill_node_at}; fix: a later step")
    if hi > 1 and opts.kill_at:
        raise ConfigError(f"--kill-at={opts.kill_at[0]} kills a worker of a single-node job; "
                          "with --nnodes use --kill-node-at")
    for world in world_sizes(opts):
        check_global_batch(opts.global_batch_size, world, opts.batch_size,
                           name="--global-batch-size")


def world_sizes(opts: ElasticOptions) -> list[int]:
    """Every world size the job can take: nodes from MIN to MAX, ``nproc`` workers each."""
    lo, hi = parse_nnodes(opts.nnodes)
    return [n * opts.nproc for n in range(lo, hi + 1)]


def demo_dataset_len(samples: int | None) -> int:
    """Samples the demo trains on: ``--samples`` or the whole packaged corpus."""
    full = corpus_windows()
    if samples is not None and not 1 <= samples <= full:
        raise ConfigError(f"--samples={samples}: the demo corpus has {full} windows; fix: "
                          f"1..{full}")
    return full if samples is None else samples


def check_resumable(opts: ElasticOptions, store: Store) -> None:
    """The newest committed snapshot must have been taken on a dataset of this length."""
    manifest = _newest_manifest(store)
    current = demo_dataset_len(opts.samples)
    if manifest is not None and manifest.dataset_len not in (None, current):
        raise ResumeMismatchError(
            f"the demo dataset has {current} samples but the newest snapshot in "
            f"{store.url} (step {manifest.step}) was taken with {manifest.dataset_len}; fix: "
            f"resume with --samples={manifest.dataset_len}, or use a fresh --storage"
        )


def _newest_manifest(store: Store) -> Manifest | None:
    # A directory without a manifest is a partial write: the workers' discovery skips it too.
    return next((c.manifest for c in newest_first(store) if c.manifest is not None), None)
