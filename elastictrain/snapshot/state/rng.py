"""Capture and restore every random number generator a training step may use.

States are plain tensors, ints, tuples and lists so the payload stays loadable
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

from elastictrain.snapshot.format.tensorbytes import tensor_bytes

try:  # numpy is optional
    import numpy as np
except ImportError:  # pragma: no cover - numpy is installed with the test extra
    np = None  # type: ignore[assignment]


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: python, torch CPU, CUDA (if initialised), numpy."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        # Its 625 words as one tensor, not a tuple of ints: a save walks every leaf of
        # every rank's RNG state (docs/performance.md).
        "python": (version, torch.tensor(internal, dtype=torch.int64), gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = (name, torch.from_numpy(np.asarray(keys).astype("int64")), int(pos),
                          int(has_gauss), float(cached))
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's RNGs from :func:`capture_rng` output.

    Loaded states are views into one storage (staging slabs); ``set_rng_state``
    reads from the start of a tensor's storage and ignores its offset (torch
    2.13), so each state is cloned into a tensor of its own first.
    """
    version, internal, gauss = state["python"]
    if isinstance(internal, torch.Tensor):  # else a tuple of ints (older snapshots)
        internal = internal.tolist()
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].clone())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.clone() for s in state["cuda"]])
    if "numpy" in state and np is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def reseed_for_new_world(base: dict[str, Any], step: int, rank: int) -> int:
    """The rule when the world size changed since the snapshot; returns the seed used.

    With the same world size every rank restores its own saved state (1:1 by rank)
    and the run continues bit-exactly. With another world size there is no
    one-to-one mapping of streams, so each rank seeds python, torch (CPU and
    CUDA) and numpy with::

        seed = int.from_bytes(sha256(rank-0 torch state bytes || step || rank)[:8]) mod 2**63

    which is deterministic (the same snapshot and new rank always give the same
    stream, also on a second resume) and distinct per rank and per step.
    """
    digest = hashlib.sha256(tensor_bytes(base["torch"]).tobytes())
    digest.update(f"|{step}|{rank}".encode())
    seed = int.from_bytes(digest.digest()[:8], "little") % (2**63)
    random.seed(seed)
    torch.manual_seed(seed)
    if np is not None:
        np.random.seed(seed % (2**32))
    return seed
