"""Case 12: signed manifests. With ELASTICTRAIN_SIGNING_KEY set, a snapshot whose
manifest is unsigned or forged (an attacker can recompute crc32, not the HMAC) is
never deserialized; without a key, checksums show integrity only."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

import elastictrain as et
from elastictrain.errors import ConfigError, SnapshotUntrusted
from elastictrain.snapshot import layout, reader
from elastictrain.snapshot.checksum import checksum_bytes
from elastictrain.snapshot.commit import SnapshotMeta, persist_snapshot
from elastictrain.storage import FsspecStore, open_store

KEY = "k3y-" + "0123456789abcdef" * 2  # distinctive: grepped for in every output


class _RunsCode:
    """Unpickling this (without weights_only) would create a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def _meta(step: int) -> SnapshotMeta:
    return SnapshotMeta(run_id="t", step=step, epoch=0, world_size=1, checksum_algorithm="crc32")


def _forge(store: FsspecStore, step: int, payload: bytes, signature: str | None,
           template_step: int = 10) -> None:
    """What someone with write access to the storage but not the key can plant: any
    payload, with a manifest (copied from ``template_step``) whose size and crc32 match."""
    template = json.loads(store.read_bytes(f"{layout.step_dir(template_step)}/{layout.MANIFEST}"))
    template.update(step=step, signature=signature, objects=[{
        "name": layout.PAYLOAD, "size_bytes": len(payload),
        "checksum": checksum_bytes(payload, "crc32")}])
    store.write_bytes(f"{layout.step_dir(step)}/{layout.PAYLOAD}", payload)
    store.write_bytes(f"{layout.step_dir(step)}/{layout.MANIFEST}", json.dumps(template).encode())


def _torch_save_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every deserialization the reader attempts."""
    calls: list[int] = []
    real = torch.load

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(reader.torch, "load", counting)
    return calls


def _signed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FsspecStore:
    monkeypatch.setenv("ELASTICTRAIN_SIGNING_KEY", KEY)
    store = open_store(str(tmp_path / "run"))
    persist_snapshot(store, {"model": {"w": torch.full((8,), 10.0)}}, _meta(10))
    return store


def test_signed_manifest_carries_an_hmac_never_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _signed_run(tmp_path, monkeypatch)
    raw = store.read_bytes(f"{layout.step_dir(10)}/{layout.MANIFEST}")
    assert json.loads(raw)["signature"].startswith("hmac-sha256:")
    assert KEY.encode() not in raw
    assert reader.read_manifest(store, 10).step == 10


@pytest.mark.parametrize("signature", [None, "copied"], ids=["unsigned", "copied-signature"])
def test_forged_crc32_manifest_is_never_unpickled_with_a_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loads: list[int],
        signature: str | None) -> None:
    store = _signed_run(tmp_path, monkeypatch)
    if signature == "copied":  # a genuine signature of another manifest
        signature = reader.read_manifest(store, 10).signature
    marker = tmp_path / "code-ran"
    _forge(store, 20, _torch_save_bytes({"model": _RunsCode(str(marker))}), signature)
    with capture_logs() as logs, pytest.raises(SnapshotUntrusted) as info:
        reader.load_verified(store, 20)
    assert loads == [] and not marker.exists()
    assert "step_000000000020" in str(info.value) and KEY not in str(info.value)
    unsigned = [e for e in logs if e["event"] == "snapshot.unsigned"]
    assert unsigned and unsigned[0]["snapshot_step"] == 20
    assert KEY not in repr(logs)
    # Discovery skips it and finds our own snapshot.
    found = reader.find_latest_verified(store)
    assert found is not None and found.step == 10


def test_restore_skips_the_forged_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           loads: list[int]) -> None:
    monkeypatch.setenv("ELASTICTRAIN_SIGNING_KEY", KEY)
    model = torch.nn.Linear(2, 1)
    snap = et.SnapshotManager(str(tmp_path / "run"), model=model, every_steps=1)
    snap.step()
    snap.close()
    store = open_store(str(tmp_path / "run"))
    bogus = {**torch.load(io.BytesIO(store.read_bytes(f"{layout.step_dir(1)}/{layout.PAYLOAD}")),
                          weights_only=True)}
    bogus["model"] = {k: torch.full_like(v, 99.0) for k, v in bogus["model"].items()}
    loads.clear()
    _forge(store, 5, _torch_save_bytes(bogus), None, template_step=1)
    again = et.SnapshotManager(str(tmp_path / "run"), model=torch.nn.Linear(2, 1),
                               every_steps=1)
    with capture_logs() as logs:
        info = again.restore()
    again.close()
    assert info.from_step == 1
    assert len(loads) == 1  # only step 1, ours, was deserialized
    assert any(e["event"] == "snapshot.unsigned" and e["snapshot_step"] == 5 for e in logs)


def test_without_a_key_a_forged_crc32_manifest_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Documented in docs/trust.md: the checksum shows integrity, not authorship."""
    store = _signed_run(tmp_path, monkeypatch)
    _forge(store, 20, _torch_save_bytes({"model": {"w": torch.full((8,), 66.0)}}), None)
    monkeypatch.delenv("ELASTICTRAIN_SIGNING_KEY")
    _, payload = reader.load_verified(store, 20)
    assert torch.equal(payload["model"]["w"], torch.full((8,), 66.0))


def test_a_short_key_is_refused_without_quoting_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICTRAIN_SIGNING_KEY", "tiny-secret")
    store = open_store(str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="ELASTICTRAIN_SIGNING_KEY is 11 characters") as info:
        persist_snapshot(store, {"w": torch.zeros(1)}, _meta(1))
    assert "tiny-secret" not in str(info.value)
