"""Case 12 end to end under real torchrun: with ELASTICTRAIN_SIGNING_KEY set, the demo
resumes from its own signed snapshot and never from a planted one whose crc32
manifest was recomputed; the key appears in no output and no file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastictrain.core import layout
from elastictrain.snapshot.format.checksum import checksum_bytes
from tests.helpers import events, run_cli

pytestmark = pytest.mark.distributed

KEY = "e2e-signing-key-" + "5f3c9a1be7d24680" * 2


def _demo(tmp_path: Path, storage: Path, steps: int) -> tuple[dict[str, Any], str]:
    result = run_cli(["demo", "--json", f"--storage={storage}", f"--steps={steps}",
                      "--snapshot-every=10", "--keep=5"], tmp_path,
                     ELASTICTRAIN_SIGNING_KEY=KEY)
    assert result.returncode == 0, f"demo failed ({result.returncode}):\n{result.stderr[-4000:]}"
    return dict(json.loads(result.stdout)), result.stdout + result.stderr


def test_demo_never_resumes_from_a_forged_snapshot(tmp_path: Path) -> None:
    storage = tmp_path / "s"
    first, out1 = _demo(tmp_path, storage, 30)
    assert first["committed_steps"] == [10, 20, 30]
    # Plant step 40: a real payload (step 10's) with a manifest whose size and crc32
    # match it, carrying step 30's genuine signature (the attacker has no key).
    payload = (storage / layout.step_dir(10) / layout.PAYLOAD).read_bytes()
    manifest = json.loads((storage / layout.step_dir(30) / layout.MANIFEST).read_bytes())
    manifest.update(step=40, objects=[{"name": layout.PAYLOAD, "size_bytes": len(payload),
                                       "checksum": checksum_bytes(payload, "crc32")}])
    forged = storage / layout.step_dir(40)
    forged.mkdir()
    (forged / layout.PAYLOAD).write_bytes(payload)
    (forged / layout.MANIFEST).write_text(json.dumps(manifest))

    second, out2 = _demo(tmp_path, storage, 50)
    assert second["resumed_from"] == [30]
    assert second["final_step"] == 50
    unsigned = events(Path(second["events_dir"]), "snapshot.unsigned")
    assert unsigned and {e["snapshot_step"] for e in unsigned} == {40}
    # The planted step was replaced by the run's own, signed snapshot of step 40.
    ours = json.loads((forged / layout.MANIFEST).read_bytes())
    assert ours["signature"] != manifest["signature"] and ours["objects"] != manifest["objects"]

    assert KEY not in out1 + out2
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
