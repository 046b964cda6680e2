"""``elastictrain.export`` in this process: the files of a replicated snapshot hold the
trained model (and optimizer) tensor for tensor, loaded back with
``safetensors.torch.load_file`` and ``torch.load(weights_only=True)``; names as the
unwrapped model gives them (DDP, ``torch.compile``); the snapshot's step, run and
checksums in the file; a damaged, partial or missing snapshot refused with nothing
written and the storage untouched; an existing file kept; a remote payload spooled;
a sharded (FSDP2) snapshot of one rank exported whole."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

import elastictrain as et
from elastictrain.core import layout
from elastictrain.core.errors import ConfigError, SnapshotCorrupt
from elastictrain.snapshot.export.contents import model_names
from elastictrain.snapshot.format.reader import read_manifest
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.storage import open_store
from tests.planted import plant_snapshot
from tests.small_job import build, one_rank_fsdp2, train

HAVE_SAFETENSORS = importlib.util.find_spec("safetensors") is not None
needs_safetensors = pytest.mark.skipif(not HAVE_SAFETENSORS, reason="needs [safetensors]")


def trained(root: Path, until: int = 10) -> tuple[torch.nn.Module, Any]:
    """small_job's model, AdamW, scheduler, scaler and sampler, trained to ``until``
    (snapshots every 5 steps); the model and optimizer as they ended."""
    model, opt, sched, sampler, snap = build(str(root))
    train(model, opt, sched, sampler, snap, until=until)
    snap.close()
    return model, opt


def same_tensors(expected: dict[str, Any], got: dict[str, Any]) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def same_optimizer(expected: dict[str, Any], got: dict[str, Any]) -> None:
    assert got["param_groups"] == expected["param_groups"]
    assert sorted(got["state"]) == sorted(expected["state"])
    for key, state in expected["state"].items():
        same_tensors(state, got["state"][key])


def files_of(root: Path) -> dict[str, str]:
    """Every file under ``root`` with the sha256 of its bytes (what a write would change)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@needs_safetensors
def test_safetensors_file_holds_the_trained_model_and_optimizer(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    model, opt = trained(tmp_path / "run")
    done = et.export(str(tmp_path / "run"), tmp_path / "m.safetensors", with_optimizer=True)
    assert (done.step, done.format, done.contents) == (10, "safetensors", ("model", "optimizer"))
    loaded = load_file(tmp_path / "m.safetensors")
    same_tensors(model.state_dict(), {k: v for k, v in loaded.items()
                                      if not k.startswith("optimizer/")})
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        metadata = f.metadata()
    skeleton = json.loads(metadata["optimizer"])
    expected = opt.state_dict()
    for key, state in expected["state"].items():  # JSON: the state's keys are strings
        for name, tensor in state.items():
            stored = skeleton["state"][str(key)][name]["tensor"]
            assert stored == f"optimizer/state/{key}/{name}"
            assert torch.equal(loaded[stored], tensor)
    assert skeleton["param_groups"][0]["params"] == expected["param_groups"][0]["params"]
    assert metadata["format"] == "pt"


def test_torch_file_holds_the_trained_model_and_optimizer(tmp_path: Path) -> None:
    model, opt = trained(tmp_path / "run")
    et.export(str(tmp_path / "run"), tmp_path / "m.pt", format="torch", with_optimizer=True)
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(loaded) == ["model", "optimizer", "elastictrain"]
    same_tensors(model.state_dict(), loaded["model"])
    same_optimizer(opt.state_dict(), loaded["optimizer"])
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.3),
                                torch.nn.Linear(6, 1))
    fresh.load_state_dict(loaded["model"])  # strict: every name matches
    with zipfile.ZipFile(tmp_path / "m.pt") as archive:
        assert archive.testzip() is None  # every record's CRC-32 in place


def test_the_model_alone_by_default_and_where_it_came_from(tmp_path: Path) -> None:
    trained(tmp_path / "run")
    et.export(str(tmp_path / "run"), tmp_path / "m.pt", format="torch")
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(loaded) == ["model", "elastictrain"]
    manifest = read_manifest(open_store(str(tmp_path / "run")), 10)
    meta = loaded["elastictrain"]
    assert (meta["step"], meta["run_id"], meta["snapshot_format"], meta["contents"]) == \
        (10, manifest.run_id, "replicated", ["model"])
    assert meta["checksums"] == {o.name: o.checksum for o in manifest.objects}
    assert meta["checksum_algorithm"] == manifest.checksum_algorithm


@needs_safetensors
def test_safetensors_metadata_names_step_run_and_checksums(tmp_path: Path) -> None:
    from safetensors import safe_open

    trained(tmp_path / "run")
    et.export(str(tmp_path / "run"), tmp_path / "m.safetensors", step=5)
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        meta = json.loads(f.metadata()["elastictrain"])
        assert not [k for k in f.keys() if k.startswith("optimizer/")]  # noqa: SIM118
    manifest = read_manifest(open_store(str(tmp_path / "run")), 5)
    assert (meta["step"], meta["run_id"]) == (5, manifest.run_id)
    assert meta["checksums"] == {o.name: o.checksum for o in manifest.objects}


def test_the_name_rule() -> None:
    ddp = ["module.0.weight", "module.0.bias"]
    assert model_names(ddp) == {"module.0.weight": "0.weight", "module.0.bias": "0.bias"}
    compiled = ["_orig_mod.module.w", "_orig_mod.module.b"]  # compile(DDP(model))
    assert list(model_names(compiled).values()) == ["w", "b"]
    inner = ["enc._orig_mod.w", "head.w"]  # a compiled submodule
    assert list(model_names(inner).values()) == ["enc.w", "head.w"]
    own = ["module.w", "head.w"]  # a submodule the user named "module": kept
    assert list(model_names(own).values()) == own


def _train_steps(model: torch.nn.Module, opt: Any, snap: SnapshotManager, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        snap.step()
    snap.close()


def test_views_that_overlap_or_stride_and_other_dtypes_come_out_as_saved(
        tmp_path: Path) -> None:
    """A payload's tensors may share bytes, stride, hold none: each comes out whole and
    contiguous, and the checksum over the single pass still matches."""
    base = torch.arange(24, dtype=torch.float32)
    model = {"a": base[0:8], "b": base[4:12].view(2, 4), "t": base[:12].view(3, 4).t(),
             "s": base[5], "e": base[0:0].view(0, 3), "h": torch.randn(3).bfloat16(),
             "m": torch.tensor([True, False]), "i": torch.arange(5, dtype=torch.int64)}
    plant_snapshot(open_store(str(tmp_path / "run")), 1, {"format": 1, "model": model,
                                                          "optimizer": None})
    expected = {k: v.contiguous() for k, v in model.items()}
    et.export(str(tmp_path / "run"), tmp_path / "m.pt", format="torch")
    same_tensors(expected, torch.load(tmp_path / "m.pt", weights_only=True)["model"])
    if HAVE_SAFETENSORS:
        from safetensors.torch import load_file

        et.export(str(tmp_path / "run"), tmp_path / "m.safetensors")
        same_tensors(expected, load_file(tmp_path / "m.safetensors"))


def test_a_dtype_safetensors_cannot_name_is_refused_with_the_fix(tmp_path: Path) -> None:
    plant_snapshot(open_store(str(tmp_path / "run")), 1, {
        "format": 1, "model": {"z": torch.zeros(2, dtype=torch.complex128)}})
    if HAVE_SAFETENSORS:
        with pytest.raises(ConfigError, match=r"complex128 .* fix: --format torch"):
            et.export(str(tmp_path / "run"), tmp_path / "m.safetensors")
        assert not (tmp_path / "m.safetensors").exists()
    et.export(str(tmp_path / "run"), tmp_path / "m.pt", format="torch")
    assert torch.load(tmp_path / "m.pt", weights_only=True)["model"]["z"].dtype == \
        torch.complex128


def test_names_of_a_ddp_wrapped_model(tmp_path: Path, one_rank_group: None) -> None:
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 1))
    model = torch.nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_steps(model, opt, SnapshotManager(str(tmp_path / "run"), model=model,
                                             optimizer=opt, every_steps=3), 3)
    et.export(str(tmp_path / "run"), tmp_path / "m.pt", format="torch")
    same_tensors(inner.state_dict(), torch.load(tmp_path / "m.pt", weights_only=True)["model"])


def test_names_of_a_compiled_model_and_a_compiled_submodule(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    plain[2] = torch.compile(plain[2], backend="eager")  # type: ignore[assignment]
    model = torch.compile(plain, backend="eager")  # the eager backend: no code generation
    assert all(k.startswith("_orig_mod.") for k in model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_steps(model, opt, SnapshotManager(str(tmp_path / "run"), model=model,
                                             optimizer=opt, every_steps=2), 2)
    et.export(str(tmp_path / "run"), tmp_path / "m.pt", format="torch")
    got = torch.load(tmp_path / "m.pt", weights_only=True)["model"]
    assert sorted(got) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    uncompiled = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(),
                                     torch.nn.Linear(6, 1))
    uncompiled.load_state_dict(got)
    same_tensors({k: v.detach() for k, v in uncompiled.state_dict().items()}, got)


def _flip_a_payload_byte(root: Path, step: int) -> None:
    (payload,) = (root / layout.step_dir(step)).glob("state*.pt")
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))


def test_a_damaged_snapshot_is_refused_nothing_written_storage_untouched(
        tmp_path: Path) -> None:
    trained(tmp_path / "run")
    _flip_a_payload_byte(tmp_path / "run", 10)
    before = files_of(tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    for fmt in ("torch", "safetensors") if HAVE_SAFETENSORS else ("torch",):
        with pytest.raises(SnapshotCorrupt, match=r"^snapshot of step 10 under .* does not "
                           r"verify, nothing was exported: .*crc32") as info:
            et.export(str(tmp_path / "run"), out / "m", step=10, format=fmt)
        assert "\n" not in str(info.value)
        assert list(out.iterdir()) == []  # no file, no temporary file
    assert files_of(tmp_path / "run") == before


def test_without_a_step_the_newest_snapshot_that_verifies(tmp_path: Path) -> None:
    trained(tmp_path / "run")
    _flip_a_payload_byte(tmp_path / "run", 10)
    with capture_logs() as logs:
        done = et.export(str(tmp_path / "run"), tmp_path / "m.pt", format="torch")
    assert done.step == 5
    assert [e["snapshot_step"] for e in logs if e["event"] == "snapshot.corrupt"] == [10]
    assert torch.load(tmp_path / "m.pt", weights_only=True)["elastictrain"]["step"] == 5


def test_a_partial_snapshot_is_refused(tmp_path: Path) -> None:
    trained(tmp_path / "run")
    (tmp_path / "run" / layout.step_dir(10) / layout.MANIFEST).unlink()
    with pytest.raises(SnapshotCorrupt, match=r"step 10 .*not committed"):
        et.export(str(tmp_path / "run"), tmp_path / "m.pt", step=10, format="torch")
    assert not (tmp_path / "m.pt").exists()


def test_a_step_that_is_not_there_is_bad_input(tmp_path: Path) -> None:
    trained(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"no snapshot of step 7 .* newest first: 10, 5;"):
        et.export(str(tmp_path / "run"), tmp_path / "m.pt", step=7, format="torch")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no snapshots under"):
        et.export(str(empty), tmp_path / "m.pt", format="torch")


def test_without_safetensors_one_line_names_the_install_and_torch_still_works(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trained(tmp_path / "run")
    monkeypatch.setitem(__import__("sys").modules, "safetensors", None)  # import fails
    with pytest.raises(ConfigError) as info:
        et.export(str(tmp_path / "run"), tmp_path / "m.safetensors")
    message = str(info.value)
    assert "pip install 'elastictrain[safetensors]'" in message and "\n" not in message
    assert not (tmp_path / "m.safetensors").exists()
    et.export(str(tmp_path / "run"), tmp_path / "m.pt", format="torch")
    assert (tmp_path / "m.pt").exists()


def test_an_existing_file_is_kept_unless_forced(tmp_path: Path) -> None:
    trained(tmp_path / "run")
    out = tmp_path / "m.pt"
    out.write_bytes(b"mine")
    with pytest.raises(ConfigError, match=r"exists; fix: .*--force"):
        et.export(str(tmp_path / "run"), out, format="torch")
    assert out.read_bytes() == b"mine"
    et.export(str(tmp_path / "run"), out, format="torch", force=True)
    assert "model" in torch.load(out, weights_only=True)
    assert sorted(os.listdir(tmp_path)) == ["m.pt", "run"]  # no temporary file left


def test_out_among_the_snapshots_or_in_no_directory_is_refused(tmp_path: Path) -> None:
    trained(tmp_path / "run")
    with pytest.raises(ConfigError, match="inside the run's snapshots/"):
        et.export(str(tmp_path / "run"), tmp_path / "run" / layout.step_dir(10) / "m.pt",
                  format="torch")
    with pytest.raises(ConfigError, match="no directory"):
        et.export(str(tmp_path / "run"), tmp_path / "nowhere" / "m.pt", format="torch")


def test_a_remote_payload_is_copied_locally_and_verified(tmp_path: Path) -> None:
    url = f"memory://export-test-{os.getpid()}-{tmp_path.name}"
    model, opt = trained(url)  # type: ignore[arg-type]
    try:
        assert open_store(url).local_path(layout.step_dir(10)) is None  # not a local file
        et.export(url, tmp_path / "m.pt", format="torch", with_optimizer=True)
        loaded = torch.load(tmp_path / "m.pt", weights_only=True)
        same_tensors(model.state_dict(), loaded["model"])
        same_optimizer(opt.state_dict(), loaded["optimizer"])
    finally:
        open_store(url).delete("", recursive=True)


def test_credentials_in_a_url_are_never_shown(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        et.export("s3://someone:hunter2@bucket/run", tmp_path / "m.pt", format="torch")
    assert "hunter2" not in str(info.value)


def test_a_sharded_snapshot_of_one_rank_is_exported_whole(tmp_path: Path,
                                                          one_rank_group: None) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, opt = one_rank_fsdp2(6, 16)
    _train_steps(model, opt, SnapshotManager(str(tmp_path / "run"), model=model,
                                             optimizer=opt, every_steps=2), 2)
    full_model, full_opt = get_state_dict(
        model, [opt], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    et.export(str(tmp_path / "run"), tmp_path / "m.pt", format="torch", with_optimizer=True)
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert loaded["elastictrain"]["snapshot_format"] == "sharded"
    same_tensors(full_model, loaded["model"])
    same_optimizer(full_opt, loaded["optimizer"])
