"""Local restore streams the checksum and memory-maps the payload: same state as the
bytes path, corrupt files still refused, and nothing but the model stays mapped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastictrain.errors import SnapshotCorrupt
from elastictrain.snapshot import layout
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.snapshot.reader import load_payload, read_verified
from elastictrain.storage import open_store


def saved(tmp_path: Path) -> tuple[SnapshotManager, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters())
    snap = SnapshotManager(str(tmp_path), model=model, optimizer=opt, every_steps=3)
    for _ in range(3):
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        snap.step()
    snap.close()
    return snap, opt


def test_streamed_and_mapped_equals_the_bytes_path(tmp_path: Path) -> None:
    saved(tmp_path)
    store = open_store(str(tmp_path))
    streamed = read_verified(store, 3, stream_local=True)
    assert streamed.local_path is not None and streamed.payload == b""
    mapped = streamed.load()
    in_memory = load_payload(read_verified(store, 3).payload)
    assert torch.equal(mapped["model"]["weight"], in_memory["model"]["weight"])
    exp_avg = mapped["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, in_memory["optimizer"]["state"][0]["exp_avg"])
    # optimizers keep the tensors they load: those must not point into the file
    assert mapped_from(streamed.local_path, mapped["model"]["weight"])
    assert not mapped_from(streamed.local_path, exp_avg)


def mapped_from(path: str, tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of ``path`` (/proc/self/maps)."""
    address = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(Path(path).resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return True
    return False


def test_restore_through_the_local_path_resumes_exactly(tmp_path: Path) -> None:
    _, opt = saved(tmp_path)
    torch.manual_seed(1)
    model = torch.nn.Linear(16, 4)
    opt2 = torch.optim.AdamW(model.parameters())
    again = SnapshotManager(str(tmp_path), model=model, optimizer=opt2, every_steps=3)
    assert again.restore().from_step == 3
    for p, q in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"], strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])


def test_a_flipped_byte_is_caught_by_the_stream(tmp_path: Path) -> None:
    saved(tmp_path)
    payload = tmp_path / layout.step_dir(3) / layout.PAYLOAD
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match="crc32"):
        read_verified(open_store(str(tmp_path)), 3, stream_local=True)
