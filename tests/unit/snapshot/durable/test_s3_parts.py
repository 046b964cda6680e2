"""Upload parts are views of the staged buffers: the state's bytes are never copied on
their way to S3, only what ``torch.save`` builds on the fly (headers, the pickle)."""

from __future__ import annotations

import base64
import io
import tracemalloc
import zlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from elastictrain.snapshot.durable.commit import serialize_payload
from elastictrain.snapshot.format.views import as_bytes
from elastictrain.storage.s3_multipart import KeptMemory, MultipartWriter, PartBuffer, RequestBody

MIB = 2**20


def _kept(*tensors: torch.Tensor) -> tuple[KeptMemory, list[np.ndarray]]:
    arrays = [as_bytes(t.untyped_storage()).numpy() for t in tensors]
    kept = KeptMemory()
    kept.add(arrays)
    return kept, arrays


def test_writes_in_kept_memory_are_one_view_and_the_rest_is_copied() -> None:
    staged = torch.randn(MIB)  # 4 MiB
    kept, (array,) = _kept(staged)
    part = PartBuffer(kept)
    whole = memoryview(array)
    part.append(memoryview(b"header"))
    for start in range(0, whole.nbytes, 256 << 10):  # the counting sink's chunks
        part.append(whole[start:start + (256 << 10)])
    other = bytes(PartBuffer._OWN_PIECE)
    part.append(memoryview(other))
    assert len(part.pieces) == 3  # header, the whole tensor as one view, the copy
    view = part.pieces[1]
    assert isinstance(view, memoryview) and view.nbytes == whole.nbytes
    assert np.shares_memory(np.frombuffer(view, np.uint8), array)
    assert isinstance(part.pieces[2], bytes)
    assert part.copied_bytes == len(b"header") + len(other)
    assert part.nbytes == whole.nbytes + part.copied_bytes


def test_a_write_only_partly_in_kept_memory_is_copied() -> None:
    staged = torch.zeros(64 << 10, dtype=torch.uint8)
    kept, _ = _kept(staged[: 32 << 10])  # a view of the first half: keeps its storage whole
    outside = torch.zeros(128 << 10, dtype=torch.uint8)
    assert kept.find(memoryview(outside.numpy())) is None
    inside = memoryview(staged.numpy())
    assert kept.find(inside) == (0, 0, inside.nbytes)


class _FakeS3:
    """Records every request of one upload; parts keep their body's pieces."""

    fixed_upload_size = False

    def __init__(self) -> None:
        self.s3 = SimpleNamespace(meta=SimpleNamespace(
            config=SimpleNamespace(request_checksum_calculation="when_supported")))
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def split_path(self, path: str) -> tuple[str, str, None]:
        bucket, key = path.split("/", 1)
        return bucket, key, None

    def call_s3(self, method: str, **kwargs: Any) -> dict[str, str]:
        self.requests.append((method, kwargs))
        return {"UploadId": "u1", "ETag": f'"{len(self.requests)}"'}

    def invalidate_cache(self, path: str) -> None:
        return None


def _state() -> dict[str, Any]:
    return {"model": {f"w{i}": torch.randn(MIB) for i in range(6)},  # 24 MiB
            "step": torch.tensor(3)}


def test_torch_save_streams_views_of_the_state_into_parts() -> None:
    """A multipart upload of a 24 MiB state holds views, not copies: Python memory
    stays far below the state, the parts are all part_size (the first too: the state
    alone exceeds single_put_max), every part carries its CRC32, and the bytes are
    exactly torch.save's."""
    state, fs = _state(), _FakeS3()
    writer = MultipartWriter(fs, "bucket/key", part_size=5 * MIB, concurrency=2,
                             single_put_max=8 * MIB, call=lambda op, fn: fn())
    tracemalloc.start()
    size, _ = serialize_payload(state, writer, "crc32")
    writer.commit()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 0.1 * size, peak

    parts = sorted((kw for op, kw in fs.requests if op == "upload_part"),
                   key=lambda kw: kw["PartNumber"])
    sizes = [len(kw["Body"]) for kw in parts]
    # The state alone exceeds single_put_max: known to be multipart, every part equal.
    assert all(s == 5 * MIB for s in sizes[:-1])
    assert 0 < sizes[-1] <= 5 * MIB and sum(sizes) == size
    assert [op for op, _ in fs.requests][-1] == "complete_multipart_upload"
    staged = [as_bytes(t.untyped_storage()).numpy() for t in state["model"].values()]
    views = [v for kw in parts for v in kw["Body"]._views if v.nbytes >= 64 << 10]
    # Every tensor byte is a view (a sliver under 64 KiB where a part ends is copied)...
    assert sum(v.nbytes for v in views) >= 24 * MIB - len(parts) * (64 << 10)
    assert all(any(np.shares_memory(np.frombuffer(v, np.uint8), a) for a in staged)
               for v in views)  # ...of the state's own memory
    sent = b"".join(kw["Body"].read() for kw in parts)
    expected = io.BytesIO()
    serialize_payload(state, expected, "crc32")
    assert sent == expected.getvalue()
    for kw in parts:
        crc = zlib.crc32(kw["Body"].read()) if kw["Body"].seek(0) == 0 else None
        assert kw["ChecksumCRC32"] == base64.b64encode(crc.to_bytes(4, "big")).decode()  # type: ignore[union-attr]


def test_one_put_below_the_threshold_is_views_too() -> None:
    state, fs = _state(), _FakeS3()
    writer = MultipartWriter(fs, "bucket/key", part_size=5 * MIB, concurrency=2,
                             single_put_max=64 * MIB, call=lambda op, fn: fn())
    tracemalloc.start()
    size, _ = serialize_payload(state, writer, "crc32")
    writer.commit()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [op for op, _ in fs.requests] == ["put_object"]
    assert len(fs.requests[0][1]["Body"]) == size and peak < 0.1 * size, peak


def test_no_checksum_where_the_client_sends_none() -> None:
    fs = _FakeS3()
    fs.s3.meta.config.request_checksum_calculation = "when_required"
    writer = MultipartWriter(fs, "bucket/key", part_size=5 * MIB, concurrency=1,
                             call=lambda op, fn: fn())
    writer.write(b"x" * 100)
    writer.commit()
    assert "ChecksumCRC32" not in fs.requests[0][1]


def test_request_body_crc32_is_s3s_header_value() -> None:
    data = bytes(range(256)) * 5000
    body = RequestBody([data[:1000], memoryview(data)[1000:]])
    assert body.crc32_base64() == base64.b64encode(
        zlib.crc32(data).to_bytes(4, "big")).decode()
