"""The upload body: exact-size pieces of a part that botocore reads as a file and
aiohttp sends as views, no whole copy."""

from __future__ import annotations

import asyncio
import io

from elastictrain.storage.s3_multipart import PartBuffer, RequestBody

DATA = bytes(range(256)) * 10


def _part(data: bytes, cuts: list[int]) -> PartBuffer:
    part = PartBuffer()
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        part.append(memoryview(data)[start:end])
    return part


async def _collect(body: RequestBody) -> list[memoryview]:
    return [piece async for piece in body]


def test_small_writes_are_gathered_large_ones_kept_whole() -> None:
    big = bytes(PartBuffer._OWN_PIECE)
    part = PartBuffer()
    for chunk in (b"ab", b"cd", big, b"ef", b"gh"):
        part.append(memoryview(chunk))
    assert [bytes(p) for p in part.pieces] == [b"abcd", big, b"efgh"]
    assert part.nbytes == len(big) + 8


def test_botocore_reads_it_as_a_file_and_seeks_back() -> None:
    body = RequestBody(_part(DATA, [7, 1000, 1001]).pieces)
    assert len(body) == len(DATA) and body.tell() == 0
    assert body.read(100) == DATA[:100] and body.tell() == 100
    assert body.read(950) == DATA[100:1050]  # across pieces
    assert body.read() == DATA[1050:] and body.read(5) == b""
    assert body.seek(0) == 0 and body.read(-1) == DATA
    assert body.seek(-10, io.SEEK_END) == len(DATA) - 10 and body.read() == DATA[-10:]
    assert body.seek(50, io.SEEK_CUR) == len(DATA)  # clamped at the end
    assert body.seek(-5) == 0  # and at the start


def test_every_send_is_the_whole_body_and_leaves_the_position() -> None:
    """s3fs retries a throttled request with the same body object: each send must be
    the whole body, and botocore's file position (where it signs from) unmoved."""
    data = bytes(range(256)) * 1024
    part = _part(data, [100_000, 200_000])  # three pieces of their own
    body = RequestBody(part.pieces, piece_bytes=40_000)
    for _ in range(2):
        pieces = asyncio.run(_collect(body))
        assert max(p.nbytes for p in pieces) == 40_000
        assert all(any(p.obj is q for q in part.pieces) for p in pieces)  # views, no copies
        assert b"".join(pieces) == data and body.tell() == 0


def test_an_empty_body() -> None:
    body = RequestBody(PartBuffer().pieces)
    assert len(body) == 0 and body.read() == b"" and asyncio.run(_collect(body)) == []
