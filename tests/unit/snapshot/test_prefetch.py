"""A loop that draws its next batch before the step ends (to overlap the draw with the
backward, as nanoGPT's does) resumes bit-identical when the drawn batch is kept in
``snap.rank_extras``: the snapshot's RNG state is the one after that draw, so a resume
that drew again would skip a batch. Without it, the same loop resumes on other weights
(what the guide warns about)."""

from __future__ import annotations

from pathlib import Path

import torch

import elastictrain as et
from elastictrain.snapshot.format.digest import param_digest

DATA = torch.randn(64, 4, generator=torch.Generator().manual_seed(3))


def _draw() -> torch.Tensor:
    return DATA[torch.randint(0, len(DATA), (8,))]  # the global RNG, as get_batch's


def _job(url: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, et.SnapshotManager]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = et.SnapshotManager(url, model=model, optimizer=opt, every_steps=5,
                              save_on_close=False)
    return model, opt, snap


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, snap: et.SnapshotManager,
           until: int, *, keep_prefetched: bool) -> None:
    x = snap.rank_extras.get("next_batch") if keep_prefetched else None
    if x is None:
        x = _draw()
    while snap.step_count < until:
        loss = model(x).pow(2).mean()
        x = _draw()  # the next batch, drawn before the backward
        opt.zero_grad()
        loss.backward()
        opt.step()
        if keep_prefetched:
            snap.rank_extras["next_batch"] = x  # saved with this step's snapshot
        snap.step()


def _resumed_digest(tmp_path: Path, name: str, *, keep_prefetched: bool) -> str:
    first = _job(str(tmp_path / name))
    _train(*first, until=12, keep_prefetched=keep_prefetched)  # snapshot at 10
    first[2].close()  # as if killed at step 12
    again = _job(str(tmp_path / name))
    assert again[2].restore().from_step == 10
    _train(*again, until=20, keep_prefetched=keep_prefetched)
    again[2].close()
    return param_digest(again[0])


def test_a_prefetched_batch_kept_with_the_snapshot_resumes_bit_identical(tmp_path: Path
                                                                         ) -> None:
    reference = _job(str(tmp_path / "ref"))
    _train(*reference, until=20, keep_prefetched=False)
    reference[2].close()
    want = param_digest(reference[0])
    assert _resumed_digest(tmp_path, "kept", keep_prefetched=True) == want
    assert _resumed_digest(tmp_path, "drawn again", keep_prefetched=False) != want
