"""A base install (no s3fs, no matplotlib, no safetensors: the extras) does everything the
README promises.

Each child process runs with an import path on which the extras' packages are not
found, exactly as on a machine where they were never installed (``find_spec`` returns
None, ``import`` raises ModuleNotFoundError), and its workers inherit that. Covered:
save, durable and in-place restore, the memory tier and the rescue (the demo with a
worker killed), sharded FSDP2 save and restore, and the snapshot CLI (an export in the
torch format among it); each missing extra is named in one line where a command needs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, events, run_cli

pytestmark = pytest.mark.distributed

ABSENT = ("s3fs", "matplotlib", "safetensors")

_SITECUSTOMIZE = f'''
import sys
from importlib.machinery import PathFinder

class _PathFinderWithout(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in {ABSENT!r}:
            return None
        return super().find_spec(name, path, target)

sys.meta_path[:] = [_PathFinderWithout if f is PathFinder else f for f in sys.meta_path]
'''


@pytest.fixture
def without_extras(tmp_path: Path) -> str:
    """A PYTHONPATH that hides the optional packages from every child."""
    site = tmp_path / "without-extras"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)


def _python(code: str, path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, timeout=120, check=False)


def test_the_blocker_hides_the_extras(without_extras: str) -> None:
    for name in ABSENT:
        found = _python(f"import importlib.util; print(importlib.util.find_spec({name!r}))",
                        without_extras)
        assert found.stdout.strip() == "None", found.stderr
        imported = _python(f"import {name}", without_extras)
        assert "ModuleNotFoundError" in imported.stderr


def test_demo_with_memory_tier_rescue_and_durable_restore(
        tmp_path: Path, without_extras: str) -> None:
    storage = tmp_path / "s"
    first = run_cli(["demo", "--json", f"--storage={storage}", "--steps=40",
                     "--snapshot-every=10", "--kill-at=23"], tmp_path,
                    PYTHONPATH=without_extras, ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY="5")
    assert first.returncode == 0, first.stderr[-4000:]
    out = json.loads(first.stdout)
    # The survivor rescued step 23 into node memory; the restart lost nothing.
    assert out["resumed_from"] == [None, 23] and out["final_step"] == 40
    assert events(Path(out["events_dir"]), "snapshot.rescued")
    resumed = [e for e in events(Path(out["events_dir"]), "resume") if e["from_step"] == 23]
    assert resumed and all(e["tier"] == "memory" for e in resumed)
    # A relaunch reads the durable snapshot of step 40 in place, still without numpy.
    second = run_cli(["demo", "--json", f"--storage={storage}", "--steps=45",
                      "--snapshot-every=10"], tmp_path, PYTHONPATH=without_extras)
    assert second.returncode == 0, second.stderr[-4000:]
    assert json.loads(second.stdout)["resumed_from"] == [40]
    for command in (["snapshots", "list"], ["snapshots", "verify"]):
        result = run_cli([*command, str(storage)], tmp_path, PYTHONPATH=without_extras)
        assert result.returncode == 0, result.stderr
        assert "45" in result.stdout


def test_fsdp_example_saves_and_resumes(tmp_path: Path, without_extras: str) -> None:
    storage = tmp_path / "fsdp"
    script = str(REPO / "examples" / "fsdp_resumable.py")
    for steps in (10, 15):
        result = run_cli(["run", "--no-view", "--nproc-per-node", "2", script, str(storage),
                          "--steps", str(steps), "--every", "5"], tmp_path,
                         PYTHONPATH=without_extras, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    listed = run_cli(["snapshots", "list", "--json", str(storage)], tmp_path,
                     PYTHONPATH=without_extras)
    assert 15 in {row["step"] for row in json.loads(listed.stdout)}


def test_each_missing_extra_is_named_in_one_line(
        tmp_path: Path, without_extras: str) -> None:
    s3 = run_cli(["snapshots", "list", "s3://bucket/run"], tmp_path,
                 PYTHONPATH=without_extras)
    assert s3.returncode != 0
    assert "elastictrain[s3]" in s3.stderr and len(s3.stderr.strip().splitlines()) == 1
    run = run_cli(["demo", "--json", f"--storage={tmp_path / 'd'}", "--steps=5",
                   "--snapshot-every=5"], tmp_path, PYTHONPATH=without_extras)
    assert run.returncode == 0, run.stderr[-4000:]
    plot = run_cli(["goodput", json.loads(run.stdout)["events_dir"], "--plot",
                    str(tmp_path / "p.png")], tmp_path, PYTHONPATH=without_extras)
    assert plot.returncode != 0 and not (tmp_path / "p.png").exists()
    assert "elastictrain[plot]" in plot.stderr and len(plot.stderr.strip().splitlines()) == 1
    storage = str(tmp_path / "d")
    st = run_cli(["snapshots", "export", storage, "--format", "safetensors", "--out",
                  str(tmp_path / "m.safetensors")], tmp_path, PYTHONPATH=without_extras)
    assert st.returncode == 2 and not (tmp_path / "m.safetensors").exists()
    assert "elastictrain[safetensors]" in st.stderr and len(st.stderr.strip().splitlines()) == 1
    pt = run_cli(["snapshots", "export", storage, "--format", "torch", "--out",
                  str(tmp_path / "m.pt")], tmp_path, PYTHONPATH=without_extras)
    assert pt.returncode == 0 and (tmp_path / "m.pt").exists(), pt.stderr[-2000:]
