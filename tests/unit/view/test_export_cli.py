"""``elastictrain snapshots export`` in this process: one row for what it wrote (``--json``:
one object); a snapshot that does not verify exits 1, bad input exits 2, each with one
line on stderr and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elastictrain.cli import main
from elastictrain.core import layout
from elastictrain.storage import open_store
from tests.planted import plant_snapshot
from tests.small_job import build, train

# main() points the log at the test's captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("logging_reset")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    parts = build(str(root), every_steps=2, keep=5)
    train(*parts, until=4)
    parts[4].close()
    return root


def export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what the test printed before (a training job's log)
    with pytest.raises(SystemExit) as info:
        main(["snapshots", "export", *args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_export_prints_what_it_wrote(run_dir: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "m.pt"
    code, out, err = export(capsys, str(run_dir), "--format", "torch", "--out", str(out_file),
                            "--with-optimizer")
    assert (code, err) == (0, "")
    assert out.startswith("step=4  status=exported  format=torch  out=") and \
        "contents=model,optimizer" in out
    assert list(torch.load(out_file, weights_only=True)) == ["model", "optimizer",
                                                              "elastictrain"]
    code, out, _ = export(capsys, str(run_dir), "--step", "2", "--format", "torch", "--out",
                          str(out_file), "--force", "--json")
    row = json.loads(out)
    assert (code, row["step"], row["contents"], row["size_bytes"]) == \
        (0, 2, "model", out_file.stat().st_size)


def test_a_damaged_snapshot_exits_1_in_one_line(run_dir: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    (payload,) = (run_dir / layout.step_dir(4)).glob("state*.pt")
    payload.write_bytes(payload.read_bytes()[:-10])  # truncated
    code, out, err = export(capsys, str(run_dir), "--step", "4", "--format", "torch",
                            "--out", str(tmp_path / "m.pt"))
    assert (code, out) == (1, "")
    assert err.startswith("elastictrain: error: snapshot of step 4 under ") and \
        err.count("\n") == 1 and "truncated" in err
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.parametrize("case", ["no such step", "out exists", "no optimizer", "no storage"])
def test_bad_input_exits_2_in_one_line(case: str, run_dir: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "m.pt"
    args = [str(run_dir), "--format", "torch", "--out", str(out_file)]
    expected = {"no such step": "no snapshot of step 3", "out exists": "exists; fix:",
                "no optimizer": "holds no optimizer state", "no storage": "no such directory"}
    if case == "no such step":
        args += ["--step", "3"]
    elif case == "out exists":
        out_file.write_bytes(b"mine")
    elif case == "no optimizer":  # a snapshot saved without one
        root = tmp_path / "plain"
        plant_snapshot(open_store(str(root)), 2, {"format": 1, "optimizer": None,
                                                  "model": {"w": torch.ones(2)}})
        args = [str(root), "--format", "torch", "--out", str(out_file), "--with-optimizer"]
    else:
        args[0] = str(tmp_path / "missing")
    code, out, err = export(capsys, *args)
    assert (code, out) == (2, "")
    assert expected[case] in err and err.count("\n") == 1, err
    if case == "out exists":
        assert out_file.read_bytes() == b"mine"
    else:
        assert not out_file.exists()


def test_missing_safetensors_exits_2_naming_the_install(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "safetensors", None)
    code, _, err = export(capsys, str(run_dir), "--format", "safetensors", "--out",
                          str(tmp_path / "m.safetensors"))
    assert code == 2 and err.count("\n") == 1
    assert "pip install 'elastictrain[safetensors]'" in err
