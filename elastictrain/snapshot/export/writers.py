"""The two file formats an export writes, each laid out before any tensor is read and
then filled one tensor at a time at its place in the file.

``safetensors``: a JSON header (every tensor's name, dtype, shape and byte range, and
``__metadata__``), then the tensors' bytes back to back, in the order the source reads
them. Checked at the end with the ``safetensors`` package's own reader.

``torch``: the file ``torch.save`` would write for ``{"model": …, "optimizer": …,
"elastictrain": …}``, one storage per tensor, made by ``torch.save`` itself (under
``skip_data``) from placeholder tensors that hold no memory, so that
``torch.load(weights_only=True)`` reads it as any other; each tensor's bytes then go
into its record, and each record's CRC-32 into the zip's directory, so the archive
checks out in any zip tool.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from typing import Any, BinaryIO, Protocol, cast

import torch

from elastictrain.core.errors import ConfigError
from elastictrain.snapshot.export.contents import TensorRef, tensor_refs
from elastictrain.snapshot.format import onepass
from elastictrain.snapshot.format.checksum import new_hasher
from elastictrain.snapshot.format.tensorbytes import tensor_bytes
from elastictrain.snapshot.format.views import ViewRef, map_leaves

FORMATS = ("safetensors", "torch")
INSTALL_SAFETENSORS = "pip install 'elastictrain[safetensors]'"
OPTIMIZER_PREFIX = "optimizer/"  # a safetensors name of an optimizer tensor starts so

_WRITE_CHUNK = 64 << 20
# The names the safetensors format gives torch's dtypes.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DESCRIPTOR = b"PK\x07\x08"  # a zip data descriptor's signature (optional before its CRC)
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # a zip central directory entry's fixed part
_CENTRAL_CRC = 16  # byte offset of the CRC-32 in a central directory entry


class Writer(Protocol):
    """(after the layout is written) ``put`` every tensor once, any order → ``finish``."""

    def put(self, ref: TensorRef, tensor: torch.Tensor) -> None: ...
    def finish(self) -> None: ...


def require_safetensors() -> None:
    """Raises ConfigError naming the install command when ``safetensors`` is missing."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ConfigError("--format safetensors needs the safetensors package, which is not "
                          f"installed; fix: {INSTALL_SAFETENSORS} (or --format torch)") from None


def writer_for(fmt: str, fd: int, path: str, tree: dict[str, Any], meta: dict[str, Any],
               order: list[TensorRef]) -> Writer:
    """Lay out the file at ``path`` (open as ``fd``) for ``tree`` in format ``fmt``;
    ``order``: the order the tensors will come in."""
    if fmt == "safetensors":
        return SafetensorsWriter(fd, path, tree, meta, order)
    return TorchWriter(fd, path, tree, meta)


class SafetensorsWriter:
    """A safetensors file: the model's tensors under their names, the optimizer's under
    ``optimizer/<path in its state_dict>``; ``__metadata__`` holds ``format: pt``,
    ``elastictrain`` (JSON) and, with the optimizer, ``optimizer``: its state as JSON
    with each tensor replaced by ``{"tensor": NAME}``.

    Raises (from the constructor):
        ConfigError: a value safetensors cannot hold (a non-tensor in the model's state,
            a dtype it has no name for, optimizer state that is not JSON).
    """

    def __init__(self, fd: int, path: str, tree: dict[str, Any], meta: dict[str, Any],
                 order: list[TensorRef]) -> None:
        self._fd, self._path = fd, path
        self._names = _safetensors_names(tree)
        entries: dict[str, Any] = {}
        self._offsets: dict[TensorRef, int] = {}
        position = 0
        for ref in order:
            entries[self._names[ref]] = {"dtype": _safetensors_dtype(ref, self._names[ref]),
                                         "shape": list(ref.shape),
                                         "data_offsets": [position, position + ref.nbytes]}
            self._offsets[ref] = position
            position += ref.nbytes
        self.metadata = {"format": "pt", "elastictrain": json.dumps(meta, sort_keys=True)}
        if "optimizer" in tree:
            self.metadata["optimizer"] = _optimizer_json(tree["optimizer"], self._names)
        header = json.dumps({"__metadata__": self.metadata, **entries},
                            separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the tensors' bytes start 8-aligned
        _write_all(fd, struct.pack("<Q", len(header)) + header, 0)
        self._start = 8 + len(header)
        os.ftruncate(fd, self._start + position)

    def put(self, ref: TensorRef, tensor: torch.Tensor) -> None:
        _write_tensor(self._fd, self._start + self._offsets[ref], tensor)

    def finish(self) -> None:
        """Read the header back with the safetensors package: every name, the metadata.

        Raises:
            RuntimeError: the file does not read back as written (a bug, not the snapshot).
        """
        from safetensors import safe_open

        with safe_open(self._path, framework="pt") as f:
            names, metadata = set(f.keys()), f.metadata()
        if names != set(self._names.values()) or metadata != self.metadata:
            raise RuntimeError(f"{self._path}: the safetensors file does not read back as "
                               "written")


def _safetensors_names(tree: dict[str, Any]) -> dict[TensorRef, str]:
    names: dict[TensorRef, str] = {}
    for name, value in tree["model"].items():
        if not isinstance(value, TensorRef):
            raise ConfigError(f"the model's state holds {name!r}, a {type(value).__name__}, "
                              "not a tensor; a safetensors file holds tensors only; fix: "
                              "--format torch")
        names[value] = name
    for path, ref in tensor_refs(tree.get("optimizer"), ()):
        names[ref] = OPTIMIZER_PREFIX + "/".join(str(p) for p in path)
    if len(set(names.values())) != len(names):
        raise ConfigError("a model tensor's name starts with 'optimizer/' as the optimizer's "
                          "do; fix: export without --with-optimizer, or --format torch")
    return names


def _safetensors_dtype(ref: TensorRef, name: str) -> str:
    code = _SAFETENSORS_DTYPES.get(ref.dtype)
    if code is None:
        raise ConfigError(f"{name} is a {ref.dtype} tensor, which safetensors has no name "
                          "for; fix: --format torch")
    return code


def _optimizer_json(state: Any, names: dict[TensorRef, str]) -> str:
    def placeholder(value: Any) -> Any:
        if isinstance(value, TensorRef):
            return {"tensor": names[value]}
        raise ConfigError(f"the optimizer's state holds a {type(value).__name__}, which a "
                          "safetensors header (JSON) cannot; fix: --format torch")

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        return value

    return json.dumps(walk(state), default=placeholder, sort_keys=True)


class TorchWriter:
    """A ``torch.save`` file of ``{"model": …, ["optimizer": …,] "elastictrain": …}``."""

    def __init__(self, fd: int, path: str, tree: dict[str, Any],
                 meta: dict[str, Any]) -> None:
        self._fd, self._path = fd, path
        placeholders = _placeholders([ref for _, ref in tensor_refs(tree)], f"{path}.layout")
        with torch.serialization.skip_data():
            torch.save({**_substituted(tree, placeholders), "elastictrain": meta}, path)
        del placeholders  # unmapped
        self._offsets = _record_offsets(path, tree)
        self._crcs: dict[int, int] = {}

    def put(self, ref: TensorRef, tensor: torch.Tensor) -> None:
        offset = self._offsets.get(ref)
        if offset is None:
            return  # no bytes (an empty tensor): no record holds any
        self._crcs[offset] = _write_tensor(self._fd, offset, tensor)

    def finish(self) -> None:
        """Each record's CRC-32 into the zip's central directory and data descriptor."""
        with open(self._path, "rb") as f:
            with zipfile.ZipFile(f) as archive:
                infos, start = archive.infolist(), archive.start_dir
            f.seek(start)
            directory = f.read()
            position = 0
            for info in infos:
                fixed = _CENTRAL.unpack_from(directory, position)
                data = _data_offset(f, info)
                crc = self._crcs.get(data)
                if crc is not None:
                    packed = struct.pack("<L", crc)
                    _write_all(self._fd, packed, start + position + _CENTRAL_CRC)
                    _write_all(self._fd, packed, _descriptor_crc(self._fd,
                                                                 data + info.file_size))
                position += _CENTRAL.size + fixed[12] + fixed[13] + fixed[14]


def _placeholders(refs: list[TensorRef], scratch: str) -> dict[TensorRef, torch.Tensor]:
    """A tensor of each ref's dtype and shape, with storage of its own that holds no
    memory: a shared mapping of a sparse scratch file, never touched (``torch.save``
    under ``skip_data`` reads only the storages' sizes). The file is gone on return."""
    largest = max((ref.nbytes for ref in refs), default=0)
    with open(scratch, "wb") as f:
        f.truncate(largest)  # sparse: no blocks on disk
    try:
        made = {}
        for ref in refs:
            if ref.nbytes == 0:
                made[ref] = torch.empty(ref.shape, dtype=ref.dtype)
                continue
            storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(
                scratch, shared=True, nbytes=ref.nbytes))
            stride = torch.empty(ref.shape, device="meta").stride()
            made[ref] = torch.empty(0, dtype=ref.dtype).set_(storage, 0, ref.shape, stride)
        return made
    finally:
        os.unlink(scratch)  # the mappings keep it until they are released


def _substituted(tree: Any, placeholders: dict[TensorRef, torch.Tensor]) -> Any:
    return map_leaves(tree, lambda value: placeholders[value]
                      if isinstance(value, TensorRef) else value)


def _record_offsets(path: str, tree: dict[str, Any]) -> dict[TensorRef, int]:
    """Where each tensor's bytes go in the file ``torch.save`` laid out: read back as
    ``format/onepass.py`` reads a payload (tensors without bytes have no place)."""
    plan = onepass.plan(path)
    if plan is None:
        raise RuntimeError(f"{path}: torch.save wrote a layout this elastictrain does not "
                           "recognise; fix: --format safetensors")
    regions = {r.storage: r for r in plan.regions}
    offsets = {}
    for where, ref in tensor_refs(tree):
        view: Any = plan.skeleton
        for key in where:
            view = view[key]
        if isinstance(view, ViewRef) and ref.nbytes:
            offsets[ref] = regions[view.storage].offset + view.offset * ref.dtype.itemsize
    return offsets


def _data_offset(f: BinaryIO, info: zipfile.ZipInfo) -> int:
    """Where a zip record's data starts (after its local header, name and extra field)."""
    f.seek(info.header_offset)
    header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _descriptor_crc(fd: int, end: int) -> int:
    """The CRC's place in the data descriptor that follows a record ending at ``end``."""
    return end + 4 if os.pread(fd, 4, end) == _DESCRIPTOR else end


def _write_tensor(fd: int, offset: int, tensor: torch.Tensor) -> int:
    """Write a contiguous CPU tensor's bytes at ``offset``; returns their CRC-32."""
    crc = new_hasher("crc32")
    if tensor.numel() == 0:
        return 0
    view = tensor_bytes(tensor)
    for start in range(0, view.nbytes, _WRITE_CHUNK):
        piece = view[start:start + _WRITE_CHUNK]
        crc.update(piece)
        _write_all(fd, piece, offset + start)
    return int(crc.hexdigest(), 16)


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
