"""TokenDataset in DataLoader worker processes: with ``num_workers=2`` and a prefetch, a
rank gets the very batches it gets in-process (forked workers, spawned workers that
unpickle the dataset, ``memory://`` shards), also after a resume mid-epoch."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import elastictrain as et
from elastictrain.storage import open_store
from elastictrain.worker.tokens import TokenDataset
from tests.unit.worker.test_tokens import SEQ, write_shards

pytestmark = pytest.mark.processes


def batches(data: TokenDataset, sampler: et.ElasticSampler, **loader: Any) -> list[torch.Tensor]:
    """Every batch of one pass, inputs and targets side by side."""
    return [torch.cat([x, y], dim=1)
            for x, y in DataLoader(data, batch_size=sampler.batch_size, sampler=sampler,
                                   generator=torch.Generator(), **loader)]


def rank1_of_2(data: TokenDataset, cursor: int = 0) -> et.ElasticSampler:
    sampler = et.ElasticSampler(len(data), 3, 1, 2, seed=5, fingerprint=data.fingerprint)
    sampler.load_state_dict({**sampler.state_dict(), "cursor": cursor})
    return sampler


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_two_workers_with_prefetch_give_the_in_process_batches(tmp_path: Path,
                                                               context: str) -> None:
    data = TokenDataset(write_shards(tmp_path), SEQ)
    data.tokens(0)  # maps open in this process before the workers start
    expected = batches(data, rank1_of_2(data))
    assert len(expected) == 10 and all(b.shape == (3, 2 * SEQ) for b in expected)
    got = batches(data, rank1_of_2(data), num_workers=2, prefetch_factor=3,
                  multiprocessing_context=context)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_memory_shards_and_a_resume_mid_epoch_in_workers(tmp_path: Path) -> None:
    root = f"memory://tokens-{uuid.uuid4().hex}"
    store = open_store(root)
    names = [Path(path).name for path in write_shards(tmp_path)]
    for name in names:
        store.write_bytes(name, (tmp_path / name).read_bytes())
    data = TokenDataset([f"{root}/{name}" for name in names], SEQ)
    expected = batches(data, rank1_of_2(data, cursor=24))
    assert len(expected) == 6  # 36 samples left on 2 ranks of 3
    got = batches(data, rank1_of_2(data, cursor=24), num_workers=2, prefetch_factor=2,
                  persistent_workers=True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
