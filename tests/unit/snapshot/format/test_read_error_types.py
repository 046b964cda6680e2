"""Only a failed read is a storage error: an exception raised by the code that
consumes the bytes (torch.load, a missing numpy) keeps its own type and message, so
the failure summary names the real cause instead of ``StorageError: read …``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.core.errors import StorageError
from elastictrain.snapshot.format.reader import verify_snapshot
from elastictrain.storage import open_store
from tests.planted import plant_snapshot


def test_an_error_of_the_reader_keeps_its_type(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.write_bytes("obj.bin", b"x" * 10)
    with pytest.raises(RuntimeError, match="Numpy is not available") as caught, \
            store.open_read("obj.bin"):
        raise RuntimeError("Numpy is not available")
    assert not isinstance(caught.value, StorageError)


def test_an_os_error_inside_a_read_is_a_storage_error(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.write_bytes("obj.bin", b"x" * 10)
    with pytest.raises(StorageError, match=r"read .*obj\.bin: .*disk full"), \
            store.open_read("obj.bin"):
        raise OSError(28, "disk full")


def test_an_error_of_the_reading_code_keeps_its_type(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a failed read is a StorageError: an error raised by the code that turns the
    bytes into tensors (as a missing numpy once did) keeps its own type and message."""
    from elastictrain.snapshot.format import onepass

    store = open_store(str(tmp_path / "store"))
    plant_snapshot(store, 7, {"step": 7, "w": torch.randn(1000)})

    def broken(tensor: torch.Tensor) -> Any:
        raise RuntimeError("the reader's own bug")

    monkeypatch.setattr(onepass, "tensor_bytes", broken)
    with pytest.raises(RuntimeError, match="the reader's own bug") as caught:
        verify_snapshot(store, 7, load=True)
    assert not isinstance(caught.value, StorageError)
