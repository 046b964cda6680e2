"""Case 1 (save side): a value ``torch.load(weights_only=True)`` would refuse is refused
when it is staged, in the training process, with one line naming key, type and fix;
nothing is committed."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import elastictrain as et
from elastictrain.core.errors import EXIT_FATAL, UnsafeStateError
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.storage import open_store


@dataclasses.dataclass
class BestSoFar:
    loss: float
    step: int


def _manager(url: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, et.SnapshotManager]:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, et.SnapshotManager(url, model=model, optimizer=opt, every_steps=2, keep=3)


def _steps(snap: et.SnapshotManager, n: int) -> None:
    for _ in range(n):
        snap.step()


@pytest.mark.parametrize(("value", "type_name"), [
    (np.float64(0.5), "numpy.float64"),
    (Path("best.pt"), "pathlib.PosixPath"),
    (BestSoFar(0.5, 3), "BestSoFar"),
], ids=["numpy-scalar", "path", "dataclass"])
def test_unloadable_extra_is_refused_at_save_and_nothing_commits(
        tmp_path: Path, value: Any, type_name: str) -> None:
    _, _, snap = _manager(str(tmp_path / "run"))
    snap.extras["best"] = value
    snap.step()  # step 1: no save due
    with pytest.raises(UnsafeStateError) as info:
        snap.step()  # step 2: the save stages the state and must refuse it
    snap.close()
    message = str(info.value)
    assert "\n" not in message
    assert "extras['best']" in message and type_name in message
    assert "add_safe_globals" in message and "convert it to a tensor" in message
    assert info.value.exit_code == EXIT_FATAL
    assert list_snapshot_dirs(open_store(str(tmp_path / "run"))) == []


def test_unloadable_value_inside_a_user_state_dict_names_its_path(tmp_path: Path) -> None:
    _, opt, snap = _manager(str(tmp_path / "run"))
    opt.param_groups[0]["tag"] = Path("x")  # an optimizer's state_dict carries param_groups
    with pytest.raises(UnsafeStateError, match=r"optimizer\['param_groups'\]\[0\]\['tag'\]"):
        _steps(snap, 2)
    snap.close()
    assert list_snapshot_dirs(open_store(str(tmp_path / "run"))) == []


def test_every_loadable_kind_of_value_and_key_is_accepted(tmp_path: Path) -> None:
    _, _, snap = _manager(str(tmp_path / "run"))
    snap.extras.update(values=[None, True, 3, 0.5, 1j, "s", b"b", bytearray(b"x"), {1, 2},
                               torch.float16, torch.device("cpu"), torch.strided, (1, "t")],
                       keys={(0, "a"): 1, 2.5: 2, None: 3, b"k": 4, torch.int8: 5})
    _steps(snap, 2)
    snap.close()
    _, _, again = _manager(str(tmp_path / "run"))
    assert again.restore().from_step == 2
    again.close()
    assert again.extras == snap.extras


def test_type_registered_with_add_safe_globals_is_saved_and_restored(tmp_path: Path) -> None:
    with torch.serialization.safe_globals([BestSoFar]):
        _, _, snap = _manager(str(tmp_path / "run"))
        snap.extras["best"] = BestSoFar(0.25, 2)
        _steps(snap, 2)
        snap.close()
        _, _, again = _manager(str(tmp_path / "run"))
        assert again.restore().from_step == 2
        again.close()
    assert again.extras["best"] == BestSoFar(0.25, 2)
