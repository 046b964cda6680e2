"""Capture and restore every random number generator a training step may use.

States are plain tensors, ints, tuples and lists so the payload stays loadable
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:  # numpy is optional
    import numpy as np
except ImportError:  # pragma: no cover - numpy is installed with the test extra
    np = None  # type: ignore[assignment]


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: python, torch CPU, CUDA (if initialised), numpy."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        keys64 = keys.astype("int64")  # type: ignore[attr-defined]
        state["numpy"] = (name, torch.from_numpy(keys64), int(pos), int(has_gauss),
                          float(cached))
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's RNGs from :func:`capture_rng` output.

    Loaded states are views into one storage (staging slabs); ``set_rng_state``
    reads from the start of a tensor's storage and ignores its offset (torch
    2.13), so each state is cloned into a tensor of its own first.
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].clone())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.clone() for s in state["cuda"]])
    if "numpy" in state and np is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def reseed_for_new_world(base: dict[str, Any], step: int, rank: int) -> None:
    """The rule when the world size changed: derive fresh streams from the saved rank-0
    torch state, the step and the new rank, so each rank's stream is deterministic and
    distinct. Bitwise continuation is impossible when the number of streams changes."""
    anchor = int(torch.sum(base["torch"].to(torch.int64)).item())
    seed = (anchor * 1_000_003 + step * 10_007 + rank) % (2**63 - 1)
    random.seed(seed)
    torch.manual_seed(seed)
    if np is not None:
        np.random.seed(seed % (2**32))
