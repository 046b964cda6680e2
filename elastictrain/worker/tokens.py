"""TokenDataset: fixed-length language-model samples from token shard files, by index.

Token space. The shards, in the order given, are one concatenated array of ``T``
tokens; each shard is a raw array of little-endian ``uint16`` or ``uint32`` tokens (no
header: its size in bytes is its token count times 2 or 4).

Samples. Sample ``i`` is the ``seq_len + 1`` tokens from position ``i * seq_len``: the
first ``seq_len`` are the inputs, the last ``seq_len`` the targets (the inputs shifted
by one). Consecutive samples share one token (the last target of ``i`` is the first
input of ``i + 1``), so every token but the very first is a target exactly once. The
dataset has ``(T - 1) // seq_len`` samples; the tail, fewer than ``seq_len`` tokens
after the last sample's last target, is never read.

Shard boundaries. A sample that starts near the end of a shard goes on into the next:
the concatenation ignores file boundaries, and documents are separated only by the
tokens the tokenizer wrote (an end-of-text token after each). An empty shard adds
nothing.

Order and resume. The index → tokens mapping depends on the shard list, the dtype and
``seq_len`` only; the order in which indices are trained, and the position a snapshot
saves, are :class:`~elastictrain.worker.data.ElasticSampler`'s (world-size independent,
a global cursor). Give the sampler :attr:`TokenDataset.fingerprint` and a resume with
other shards is refused before anything is loaded.

Reads. Local files (a path, ``file://``) are memory-mapped with ``numpy.memmap``; any
other URL (``memory://``, ``s3://``…) reads the sample's byte range only, through
elastictrain's storage (retries, errors that name the fix). Maps and stores are opened
on first use in the process that reads, each DataLoader worker its own, and are never
pickled; a forked process opens its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from elastictrain.core.errors import ConfigError
from elastictrain.storage import Store, open_store

TOKEN_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


@dataclass(frozen=True)
class Shard:
    """One token file: where it is (a store's root and a name under it) and its size."""

    url: str
    root: str
    name: str
    tokens: int


class TokenDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples of ``seq_len`` inputs and ``seq_len`` targets packed from token shards.

    See the module docstring for the token space, the samples and the boundaries.
    ``dataset[i]`` is ``(inputs, targets)``, two int64 tensors of ``seq_len`` tokens;
    :meth:`tokens` gives the ``seq_len + 1`` raw tokens.

    Args:
        shards: token files in their training order: local paths or URLs.
        seq_len: tokens per sample's inputs (and targets).
        dtype: ``"uint16"`` (vocabularies up to 65,536) or ``"uint32"``.
        storage_options: passed to fsspec for URLs (credentials: never logged).

    Raises:
        ConfigError: a bad ``seq_len`` or ``dtype``, a shard whose size is not a whole
            number of tokens, or fewer than ``seq_len + 1`` tokens in all.
        StorageError: a shard cannot be found or read.
    """

    def __init__(self, shards: Sequence[str | os.PathLike[str]], seq_len: int,
                 dtype: str = "uint16", *,
                 storage_options: dict[str, Any] | None = None) -> None:
        if seq_len < 1:
            raise ConfigError(f"seq_len={seq_len}: must be >= 1")
        if dtype not in TOKEN_DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not a token dtype; fix: one of "
                              f"{sorted(TOKEN_DTYPES)}, as the shards were written")
        if not shards:
            raise ConfigError("TokenDataset got no shards; fix: pass the token files")
        self.seq_len = seq_len
        self.dtype = TOKEN_DTYPES[dtype]
        self._storage_options = dict(storage_options or {})
        self._readers: _Readers | None = None
        self.shards = tuple(self._measure(*_locate(s)) for s in shards)
        self._starts = [0, *accumulate(s.tokens for s in self.shards)]
        self.num_tokens = self._starts[-1]
        if self.num_tokens < seq_len + 1:
            raise ConfigError(f"the shards hold {self.num_tokens} tokens, fewer than one "
                              f"sample of seq_len={seq_len} needs ({seq_len + 1}); fix: "
                              "more shards, or a shorter seq_len")
        self.fingerprint = shards_fingerprint(self.shards, self.dtype, seq_len)

    def _measure(self, url: str, root: str, name: str) -> Shard:
        size = self._open().store(root).size(name)
        if size % self.dtype.itemsize:
            raise ConfigError(
                f"token shard {url!r} has {size} bytes, not a whole number of "
                f"{self.dtype.name} tokens; fix: the dtype it was written with, and a "
                "shard of raw tokens (no header)")
        return Shard(url, root, name, size // self.dtype.itemsize)

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def tokens(self, index: int) -> np.ndarray:
        """Sample ``index``'s ``seq_len + 1`` tokens, in the shards' dtype."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is not in [0, {len(self)})")
        start = index * self.seq_len
        stop = start + self.seq_len + 1
        readers = self._open()
        pieces = []
        k = bisect_right(self._starts, start) - 1
        while start < stop:
            end = min(stop, self._starts[k + 1])
            if end > start:
                offset = start - self._starts[k]
                pieces.append(readers.read(k, self.shards[k], offset, end - start, self.dtype))
            start, k = end, k + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        sample = torch.from_numpy(self.tokens(index).astype(np.int64))
        return sample[:-1], sample[1:]

    def _open(self) -> _Readers:
        """This process's readers (a fresh set after a fork or an unpickling)."""
        if self._readers is None or self._readers.pid != os.getpid():
            self._readers = _Readers(self._storage_options)
        return self._readers

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_readers"] = None  # open maps and stores stay in their process
        return state

    def __repr__(self) -> str:
        return (f"TokenDataset({len(self.shards)} shards, {self.num_tokens} "
                f"{self.dtype.name} tokens, seq_len={self.seq_len}: {len(self)} samples)")


class _Readers:
    """One process's open stores (by root) and memory maps (by shard)."""

    def __init__(self, storage_options: dict[str, Any]) -> None:
        self.pid = os.getpid()
        self._options = storage_options
        self._stores: dict[str, Store] = {}
        self._maps: dict[int, np.ndarray | None] = {}  # None: not a local file

    def store(self, root: str) -> Store:
        if root not in self._stores:
            self._stores[root] = open_store(root, self._options or None)
        return self._stores[root]

    def read(self, k: int, shard: Shard, offset: int, count: int,
             dtype: np.dtype[Any]) -> np.ndarray:
        """``count`` tokens of shard ``k`` from token ``offset`` on (a copy)."""
        if k not in self._maps:
            path = self.store(shard.root).local_path(shard.name)
            self._maps[k] = (None if path is None else
                             np.memmap(path, dtype=dtype, mode="r", shape=(shard.tokens,)))
        mapped = self._maps[k]
        if mapped is not None:
            return np.array(mapped[offset:offset + count])
        out = np.empty(count, dtype=dtype)
        self.store(shard.root).read_into(shard.name, out, offset * dtype.itemsize)
        return out


def _locate(shard: str | os.PathLike[str]) -> tuple[str, str, str]:
    """``(url, root, name)``: the shard as given, the directory or prefix that holds it
    (a store's root) and its file name."""
    url = os.fspath(shard)
    if "://" in url:
        scheme, rest = url.split("://", 1)
        parent, _, name = rest.rpartition("/")
        root = f"{scheme}://{parent}"
    else:
        root, name = os.path.split(os.path.abspath(url))
    if not name:
        raise ConfigError(f"token shard {url!r} names no file; fix: the path of a token file")
    return url, root, name


def shards_fingerprint(shards: Sequence[Shard], dtype: np.dtype[Any], seq_len: int) -> str:
    """A readable identity of the sample mapping: the shards' file names (not where they
    are: the data may move to another disk or bucket), token counts and order, the dtype
    and ``seq_len``. The contents are not read."""
    listing = [dtype.name, seq_len, [[s.name, s.tokens] for s in shards]]
    digest = hashlib.sha256(json.dumps(listing, separators=(",", ":")).encode()).hexdigest()
    total = sum(s.tokens for s in shards)
    return (f"{len(shards)} shards, {total} {dtype.name} tokens, seq_len {seq_len}, "
            f"sha256 {digest[:16]}")
