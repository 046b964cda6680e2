"""Only a failed read is a storage error: an exception raised by the code that
consumes the bytes (torch.load, a missing numpy) keeps its own type and message, so
the failure summary names the real cause instead of ``StorageError: read …``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.errors import StorageError
from elastictrain.snapshot.reader import verify_snapshot
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


def test_a_restore_without_numpy_says_so_not_storage(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(str(tmp_path / "store"))
    plant_snapshot(store, 7, {"step": 7, "w": torch.randn(1000)})

    def no_numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    with pytest.raises(RuntimeError, match="Numpy is not available") as caught:
        verify_snapshot(store, 7, load=True)
    assert not isinstance(caught.value, StorageError)
