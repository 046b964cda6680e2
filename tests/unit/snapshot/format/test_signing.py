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
from elastictrain.core import layout
from elastictrain.core.errors import ConfigError, SnapshotUntrusted
from elastictrain.snapshot.durable.commit import persist_snapshot
from elastictrain.snapshot.format import reader
from elastictrain.snapshot.format.checksum import checksum_bytes
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.storage import FsspecStore, open_store

KEY = "k3y-" + "0123456789abcdef" * 2  # distinctive: looked for in every output


class _RunsCode:
    """Unpickling this (without weights_only) would create a directory."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def _torch_save_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _forge(store: FsspecStore, step: int, payload: bytes, signature: str | None,
           template_step: int) -> None:
    """What someone with write access to the storage but not the key can plant: any
    payload, with a manifest (copied from ``template_step``) whose size and crc32 match."""
    where = f"{layout.step_dir(template_step)}/{layout.MANIFEST}"
    manifest = json.loads(store.read_bytes(where))
    manifest.update(step=step, signature=signature, objects=[{
        "name": layout.PAYLOAD, "size_bytes": len(payload),
        "checksum": checksum_bytes(payload, "crc32")}])
    store.write_bytes(f"{layout.step_dir(step)}/{layout.PAYLOAD}", payload)
    store.write_bytes(f"{layout.step_dir(step)}/{layout.MANIFEST}", json.dumps(manifest).encode())


def _manager(url: str) -> et.SnapshotManager:
    torch.manual_seed(0)
    return et.SnapshotManager(url, model=torch.nn.Linear(2, 1), every_steps=1)


def _run_one_step(url: str) -> dict[str, Any]:
    """A real run's snapshot of step 1; returns its state (to build forgeries from)."""
    snap = _manager(url)
    snap.step()
    snap.close()
    store = open_store(url)
    name = reader.read_manifest(store, 1).objects[0].name
    state: dict[str, Any] = torch.load(
        io.BytesIO(store.read_bytes(f"{layout.step_dir(1)}/{name}")), weights_only=True)
    return state


def test_signed_manifest_carries_an_hmac_never_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICTRAIN_SIGNING_KEY", KEY)
    store = open_store(str(tmp_path / "run"))
    meta = SnapshotMeta(run_id="t", step=10, epoch=0, world_size=1, checksum_algorithm="crc32")
    persist_snapshot(store, {"w": torch.ones(4)}, meta)
    raw = store.read_bytes(f"{layout.step_dir(10)}/{layout.MANIFEST}")
    assert json.loads(raw)["signature"].startswith("hmac-sha256:")
    assert KEY.encode() not in raw
    assert reader.read_manifest(store, 10).step == 10


@pytest.mark.parametrize("signature", [None, "copied"], ids=["unsigned", "copied-signature"])
def test_forged_crc32_manifest_is_never_unpickled_with_a_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signature: str | None) -> None:
    monkeypatch.setenv("ELASTICTRAIN_SIGNING_KEY", KEY)
    url = str(tmp_path / "run")
    _run_one_step(url)
    store = open_store(url)
    if signature == "copied":  # a genuine signature, of another manifest
        signature = reader.read_manifest(store, 1).signature
    marker = tmp_path / "code-ran"
    _forge(store, 5, _torch_save_bytes({"model": _RunsCode(str(marker))}), signature, 1)

    with pytest.raises(SnapshotUntrusted) as info:
        reader.read_manifest(store, 5)  # the gate every read path passes first
    assert "step_000000000005" in str(info.value) and KEY not in str(info.value)

    calls: list[str] = []
    real = torch.load

    def counting_load(*args: Any, **kwargs: Any) -> Any:
        calls.append("load")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    again = _manager(url)
    with capture_logs() as logs:
        resumed = again.restore()
    again.close()
    assert resumed.from_step == 1  # ours, not the planted step 5
    assert calls == ["load"] and not marker.exists()  # only step 1 was deserialized
    unsigned = [e for e in logs if e["event"] == "snapshot.unsigned"]
    assert unsigned and {e["snapshot_step"] for e in unsigned} == {5}
    assert KEY not in repr(logs)


def test_without_a_key_a_forged_crc32_manifest_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Documented in docs/trust.md: the checksum shows integrity, not authorship."""
    url = str(tmp_path / "run")
    state = _run_one_step(url)
    state["model"] = {k: torch.full_like(v, 66.0) for k, v in state["model"].items()}
    _forge(open_store(url), 5, _torch_save_bytes(state), None, 1)
    again = _manager(url)
    assert again.restore().from_step == 5
    again.close()
    assert all(bool((p == 66.0).all()) for p in again.model.parameters())


def test_a_short_key_is_refused_without_quoting_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICTRAIN_SIGNING_KEY", "tiny-secret")
    store = open_store(str(tmp_path / "run"))
    meta = SnapshotMeta(run_id="t", step=1, epoch=0, world_size=1, checksum_algorithm="crc32")
    with pytest.raises(ConfigError, match="ELASTICTRAIN_SIGNING_KEY is 11 characters") as info:
        persist_snapshot(store, {"w": torch.zeros(1)}, meta)
    assert "tiny-secret" not in str(info.value)
