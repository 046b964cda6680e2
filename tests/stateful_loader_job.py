"""A job with a torchdata ``StatefulDataLoader`` in ``state=`` (per-rank state): two
workers, prefetching, shuffled, and per-sample noise from a generator each loader
worker owns (saved by the loader as its workers' dataset state). Shared by the
in-process test (tests/processes/snapshot/) and the torchrun job
(tests/processes/e2e/stateful_loader_train.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

import elastictrain as et


class NoisyData(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``n`` samples of one rank's shard (``rank`` picks it); each read adds noise drawn
    from the loader worker's own generator, whose state the loader keeps per worker."""

    def __init__(self, n: int, rank: int = 0) -> None:
        data = torch.Generator().manual_seed(100 + rank)
        self.x, self.y = torch.randn(n, 6, generator=data), torch.randn(n, 1, generator=data)
        self._gen: torch.Generator | None = None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.rand(6, generator=self._generator()) * 0.01
        return self.x[index] + noise, self.y[index]

    def _generator(self) -> torch.Generator:
        if self._gen is None:
            info = get_worker_info()
            self._gen = torch.Generator().manual_seed(info.seed if info is not None else 0)
        return self._gen

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self._generator().get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._generator().set_state(state["gen"])


def loader(n: int, rank: int = 0) -> StatefulDataLoader:
    return StatefulDataLoader(NoisyData(n, rank), batch_size=4, shuffle=True, num_workers=2,
                              prefetch_factor=2, generator=torch.Generator().manual_seed(rank))


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.3),
                                torch.nn.Linear(6, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, data: StatefulDataLoader,
          snap: et.SnapshotManager, epochs: int, stop_at: int | None = None,
          in_step: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """The recipe's loop (docs/elastic-resume.md#per-rank-state); returns every batch's
    inputs. ``stop_at``: leave after that step, as a killed worker would; ``in_step``:
    called with the step under way between its forward and its backward."""
    seen = []
    while snap.epoch < epochs:
        for x, y in data:
            loss = torch.nn.functional.mse_loss(model(x), y)
            if in_step is not None:
                in_step(snap.step_count + 1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            snap.step()
            seen.append(x)
            if snap.step_count == stop_at:
                return seen
        snap.epoch += 1
    return seen
