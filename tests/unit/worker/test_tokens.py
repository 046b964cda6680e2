"""TokenDataset: the right tokens at every index (uint16, uint32, across shard
boundaries, from local files and memory://), an order and a length that do not depend on
the world size, exact resume at another world size, and a resume over other shards
refused before anything is loaded.

The shards hold ``BASE + position`` at every position of the concatenated token space,
so a sample's first token says which sample it is, independently of the dataset's code.
"""

from __future__ import annotations

import pickle
import re
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import elastictrain as et
from elastictrain.core.errors import ConfigError, ResumeMismatchError
from elastictrain.storage import FsspecStore, open_store
from elastictrain.worker.tokens import TokenDataset
from tests.s3server import S3Bucket

SEQ = 8
# Uneven shards: samples cross boundaries, one spans three shards (the 5-token shard),
# an empty shard adds nothing. 1 + 60 * 8 tokens make 60 samples, plus a 5-token tail.
SIZES = [35, 0, 5, 202, 244]
BASES = {"uint16": 1000, "uint32": 70_000}  # uint32: values above uint16's range


def write_shards(directory: Path, sizes: list[int] = SIZES, dtype: str = "uint16",
                 names: list[str] | None = None) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    paths, start = [], BASES[dtype]
    for i, size in enumerate(sizes):
        path = directory / (names[i] if names else f"shard{i:03d}.bin")
        np.arange(start, start + size, dtype=np.dtype(dtype).newbyteorder("<")).tofile(path)
        paths.append(str(path))
        start += size
    return paths


def sample_id(inputs: torch.Tensor, dtype: str = "uint16") -> int:
    """Which sample ``inputs`` are, from the tokens alone."""
    return (int(inputs.reshape(-1, SEQ)[0, 0]) - BASES[dtype]) // SEQ


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_every_sample_holds_its_tokens_across_shard_boundaries(tmp_path: Path,
                                                               dtype: str) -> None:
    data = TokenDataset(write_shards(tmp_path, dtype=dtype), SEQ, dtype)
    total = sum(SIZES)
    assert data.num_tokens == total and len(data) == (total - 1) // SEQ == 60
    for i in range(len(data)):
        expected = np.arange(i * SEQ, i * SEQ + SEQ + 1) + BASES[dtype]
        assert data.tokens(i).dtype == np.dtype(dtype)
        assert np.array_equal(data.tokens(i), expected), i
        inputs, targets = data[i]
        assert inputs.dtype == targets.dtype == torch.int64
        assert inputs.tolist() == expected[:-1].tolist()
        assert targets.tolist() == expected[1:].tolist()
    # Sample 4 (tokens 32..40) reads shards 0, 2 and 3; the tail (5 tokens) is never read.
    assert data.tokens(4).tolist() == list(range(BASES[dtype] + 32, BASES[dtype] + 41))
    assert int(data.tokens(59)[-1]) == BASES[dtype] + 480 < BASES[dtype] + total - 1
    with pytest.raises(IndexError):
        data.tokens(60)


def test_memory_shards_read_only_their_ranges(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    root = f"memory://tokens-{uuid.uuid4().hex}"
    store = open_store(root)
    local = write_shards(tmp_path)
    urls = []
    for path in local:
        store.write_bytes(Path(path).name, Path(path).read_bytes())
        urls.append(f"{root}/{Path(path).name}")
    remote, files = TokenDataset(urls, SEQ), TokenDataset(local, SEQ)
    assert len(remote) == len(files) and remote.fingerprint == files.fingerprint
    reads: list[tuple[str, int, int]] = []
    read_into = FsspecStore.read_into

    def recorded(self: FsspecStore, path: str, buffer: Any, offset: int = 0,
                 **kw: Any) -> int:
        reads.append((path, offset, memoryview(buffer).nbytes))
        return read_into(self, path, buffer, offset, **kw)

    monkeypatch.setattr(FsspecStore, "read_into", recorded)
    remote.tokens(4)  # tokens 32..40: three ranges of three shards
    assert reads == [("shard000.bin", 2 * 32, 2 * 3), ("shard002.bin", 0, 2 * 5),
                     ("shard003.bin", 0, 2 * 1)]
    for i in range(len(files)):
        assert np.array_equal(remote.tokens(i), files.tokens(i))
    assert max(size for *_, size in reads) == 2 * (SEQ + 1)  # never more than a sample


@pytest.mark.s3
def test_s3_shards_are_read_by_ranges(tmp_path: Path, s3: S3Bucket) -> None:
    store = open_store(s3.url("tokens"), s3.options)
    local = write_shards(tmp_path, dtype="uint32")
    for path in local:
        store.write_bytes(Path(path).name, Path(path).read_bytes())
    remote = TokenDataset([f"{s3.url('tokens')}/{Path(p).name}" for p in local], SEQ,
                          "uint32", storage_options=s3.options)
    files = TokenDataset(local, SEQ, "uint32")
    assert remote.fingerprint == files.fingerprint

    def gets() -> int:
        return len(s3.server.faults.seen(lambda r: r.op == "GetObject"))

    before = gets()
    assert np.array_equal(remote.tokens(4), files.tokens(4))
    assert gets() - before == 3  # one ranged GET per shard the sample touches
    for i in range(len(files)):
        assert np.array_equal(remote.tokens(i), files.tokens(i))
    assert s3.options["secret"] not in repr(remote) + remote.fingerprint


def test_it_pickles_without_open_maps_and_reads_after(tmp_path: Path) -> None:
    data = TokenDataset(write_shards(tmp_path), SEQ)
    first = data.tokens(10)  # maps opened in this process
    state = data.__getstate__()
    assert state["_readers"] is None and "memmap" not in repr(state)
    again = pickle.loads(pickle.dumps(data))
    assert np.array_equal(again.tokens(10), first) and again.fingerprint == data.fingerprint


def epoch(data: TokenDataset, world: int, batch: int = 4) -> list[int]:
    """One epoch on ``world`` ranks, through a DataLoader per rank: the sample ids every
    rank trained, read from the tokens."""
    samplers = [et.ElasticSampler(len(data), batch, r, world, seed=3,
                                  fingerprint=data.fingerprint) for r in range(world)]
    return consume(data, samplers, steps=None)


def consume(data: TokenDataset, samplers: list[et.ElasticSampler],
            steps: int | None) -> list[int]:
    """``steps`` optimizer steps (None: to the epoch's end) of every rank's DataLoader;
    the ids trained, read from the tokens. Every rank advances its sampler per step."""
    loaders = [iter(DataLoader(data, batch_size=s.batch_size, sampler=s)) for s in samplers]
    seen: list[int] = []
    done = 0
    while steps is None or done < steps:
        batches = [next(loader, None) for loader in loaders]
        if batches[0] is None:
            assert all(b is None for b in batches)  # every rank has as many batches
            break
        for inputs, targets in batches:  # type: ignore[misc]
            assert torch.equal(inputs[:, 1:], targets[:, :-1])
            seen += [sample_id(row) for row in inputs]
        for s in samplers:
            s.advance()
        done += 1
    return seen


def test_order_and_length_do_not_depend_on_the_world_size(tmp_path: Path) -> None:
    data = TokenDataset(write_shards(tmp_path), SEQ)
    orders = {tuple(et.ElasticSampler(len(data), 4, 0, w, seed=3).epoch_order(1))
              for w in (1, 2, 3)}
    assert len(orders) == 1 and len(data) == 60
    for world in (1, 2, 3):
        trained = epoch(data, world)
        assert Counter(trained) == Counter(range(60)), world  # 60: no padding at 1, 2, 3
    assert epoch(data, 1) == et.ElasticSampler(60, 4, seed=3).epoch_order(0)


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 1), (2, 1), (1, 3)])
def test_a_resume_at_another_world_size_trains_the_rest_once(tmp_path: Path, before: int,
                                                             after: int) -> None:
    data = TokenDataset(write_shards(tmp_path), SEQ)
    old = [et.ElasticSampler(60, 4, r, before, seed=3, fingerprint=data.fingerprint)
           for r in range(before)]
    trained = consume(data, old, steps=2)
    saved = pickle.loads(pickle.dumps(old[0].state_dict()))  # as a snapshot holds it
    new = [et.ElasticSampler(60, 4, r, after, seed=3, fingerprint=data.fingerprint)
           for r in range(after)]
    for s in new:
        s.load_state_dict(saved)
    assert new[0].cursor == 8 * before
    pad = new[0].epoch_padding()  # the documented tail: the epoch's first `pad` again
    trained += consume(data, new, steps=None)
    expected = Counter(range(60)) + Counter(new[0].epoch_order()[:pad])
    assert Counter(trained) == expected and 0 <= pad < after


# -- the shards a snapshot was taken with ----------------------------------------------------


def snapshot_run(url: str, data: TokenDataset, steps: int) -> et.SnapshotManager:
    torch.manual_seed(0)
    model = torch.nn.Linear(SEQ, 1)
    sampler = et.ElasticSampler(len(data), 4, fingerprint=data.fingerprint)
    snap = et.SnapshotManager(url, model=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.01), sampler=sampler, every_steps=1)
    snap.restore()
    for inputs, _ in DataLoader(data, batch_size=4, sampler=sampler):
        if snap.step_count >= steps:
            break
        model(inputs.float()).mean().backward()
        snap.step()
    return snap


CHANGES = {
    "a shard renamed": dict(names=[f"part{i}.bin" for i in range(5)]),
    "a shard of another size": dict(sizes=[35, 0, 5, 203, 243]),
    "the shards in another order": dict(sizes=[244, 202, 5, 0, 35]),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_resume_over_other_shards_is_refused_in_one_line(tmp_path: Path,
                                                           change: str) -> None:
    url = str(tmp_path / "run")
    snapshot_run(url, TokenDataset(write_shards(tmp_path / "a"), SEQ), steps=3).close()
    other = TokenDataset(write_shards(tmp_path / "b", **CHANGES[change]), SEQ)  # type: ignore[arg-type]
    assert len(other) == 60  # the length alone would not tell
    with pytest.raises(ResumeMismatchError) as refused:
        snapshot_run(url, other, steps=6)
    message = str(refused.value)
    assert "\n" not in message and "fix: resume with the data the snapshot" in message
    assert other.fingerprint in message and "5 shards, 486 uint16 tokens, seq_len 8" in message


def test_the_same_shards_moved_elsewhere_resume(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    snapshot_run(url, TokenDataset(write_shards(tmp_path / "disk"), SEQ), steps=3).close()
    moved = TokenDataset(write_shards(tmp_path / "nfs" / "copy"), SEQ)
    snap = snapshot_run(url, moved, steps=6)
    assert snap.step_count == 6 and snap.sampler is not None and snap.sampler.cursor == 24
    snap.close()


def test_fingerprint_covers_names_sizes_order_dtype_and_seq_len(tmp_path: Path) -> None:
    paths = write_shards(tmp_path / "a", sizes=[100, 100])
    base = TokenDataset(paths, SEQ).fingerprint
    assert base.startswith("2 shards, 200 uint16 tokens, seq_len 8, sha256 ")
    others = {
        TokenDataset(paths, SEQ + 1).fingerprint,
        TokenDataset(paths[::-1], SEQ).fingerprint,
        TokenDataset(paths, SEQ, "uint32").fingerprint,  # 200 bytes: 50 uint32 tokens
        TokenDataset(write_shards(tmp_path / "b", sizes=[100, 100], names=["x", "y"]),
                     SEQ).fingerprint,
    }
    assert base not in others and len(others) == 4


def test_a_sampler_without_the_fingerprint_is_refused(tmp_path: Path) -> None:
    data = TokenDataset(write_shards(tmp_path), SEQ)
    with_it = et.ElasticSampler(len(data), 4, fingerprint=data.fingerprint)
    without = et.ElasticSampler(len(data), 4)
    with pytest.raises(ResumeMismatchError, match=r"fingerprint \(none\) differs"):
        without.load_state_dict(with_it.state_dict())
    state = without.state_dict()
    del state["fingerprint"]  # sampler state saved without the key
    et.ElasticSampler(len(data), 4).load_state_dict(state)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(seq_len=0), "seq_len=0: must be >= 1"),
    (dict(dtype="int32"), "dtype='int32' is not a token dtype; fix:"),
    (dict(seq_len=500), "hold 486 tokens, fewer than one sample of seq_len=500"),
])
def test_bad_settings_name_the_fix(tmp_path: Path, kwargs: dict[str, object],
                                   message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        TokenDataset(write_shards(tmp_path), **{"seq_len": SEQ, **kwargs})  # type: ignore[arg-type]


def test_a_shard_of_a_partial_token_is_refused(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, sizes=[10, 10])
    with open(paths[1], "ab") as f:
        f.write(b"\0")
    with pytest.raises(ConfigError, match=r"has 21 bytes, not a whole number of uint16 "
                                          r"tokens; fix:"):
        TokenDataset(paths, SEQ)
