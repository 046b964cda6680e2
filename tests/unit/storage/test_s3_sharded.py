"""Sharded snapshots on a real S3 server (moto): parts first, the manifest last and
create-only, exact resume through ranged reads, a missing part falls back."""

from __future__ import annotations

import pytest
import torch

from elastictrain.core import layout
from elastictrain.snapshot.format.reader import read_manifest
from tests.s3server import S3Bucket
from tests.small_job import build, train
from tests.unit.storage.test_s3_snapshots import s3_store

pytestmark = pytest.mark.s3


def test_sharded_commit_order_resume_and_fallback(s3: S3Bucket) -> None:
    store = s3_store(s3)
    ref = build(s3.url("ref"), sharded=True, storage_options=s3.options)
    ref_losses = train(*ref, until=14)
    ref[4].close()

    model, opt, sched, sampler, snap = build(  # ends as a killed run: no final save
        store, sharded=True, save_on_close=False)  # type: ignore[arg-type]
    train(model, opt, sched, sampler, snap, until=8)  # snapshot at 5
    snap.close()
    writes = [r for r in s3.server.faults.seen(lambda r: r.method in ("PUT", "POST"))
              if "/run/snapshots/step_000000000005/" in r.path]
    names = [r.path.rsplit("/", 1)[1] for r in writes]
    assert names[-1] == layout.MANIFEST and writes[-1].if_none_match == "*"
    assert set(names[:-1]) == {o.name for o in read_manifest(store, 5).objects}

    model, opt, sched, sampler, snap = build(  # no final save: 10 stays the newest
        store, sharded=True, save_on_close=False)  # type: ignore[arg-type]
    assert snap.restore().from_step == 5
    assert train(model, opt, sched, sampler, snap, until=14) == ref_losses[5:]
    snap.close()
    for got, want in zip(model.parameters(), ref[0].parameters(), strict=True):
        assert torch.equal(got, want)

    part = next(o.name for o in read_manifest(store, 10).objects if o.name.endswith(".distcp"))
    store.delete(f"{layout.step_dir(10)}/{part}")
    *_, again = build(store, sharded=True)  # type: ignore[arg-type]
    assert again.restore().from_step == 5
    again.close()
