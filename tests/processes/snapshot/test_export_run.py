"""Snapshots written by 2 gloo ranks under torchrun (tests/train_job.py), exported whole
and compared with the full state rank 0 wrote at the end (``--full-state``): FSDP2
(one weight split along its rows, one along its columns), exported through the API
and through the ``elastictrain`` command as a child process; DDP, whose names carry no
``module.``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import elastictrain as et
from elastictrain.snapshot.format.reader import read_manifest
from elastictrain.snapshot.format.sharded_reader import object_of, read_object
from elastictrain.snapshot.sharded.dcp_io import parse_metadata
from elastictrain.storage import open_store
from tests.helpers import REPO, TRAIN_JOB, free_port, run_cli, started
from tests.unit.snapshot.export.test_export import same_optimizer, same_tensors

pytestmark = pytest.mark.distributed

STEPS, EVERY = 6, 3


def train_two_ranks(tmp_path: Path, name: str, *job_args: str) -> tuple[Path, dict[str, Any]]:
    """Train train_job's MLP with AdamW on 2 ranks to STEPS (snapshots every EVERY);
    the storage root and the full state rank 0 wrote at the end."""
    root, full = tmp_path / name, tmp_path / f"{name}-full.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={free_port()}", "--max-restarts=0", str(TRAIN_JOB), str(root),
           str(STEPS), f"--every={EVERY}", "--model=mlp", "--optimizer=adamw",
           f"--full-state={full}", *job_args]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    with started(cmd, tmp_path, f"{name}.log", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                 PYTHONPATH=path) as proc:
        try:
            code = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            code = None
    assert code == 0, f"{name} ended {code}:\n" + (tmp_path / f"{name}.log").read_text()[-4000:]
    return root, torch.load(full, weights_only=True)


def saved_chunks(root: Path, fqn: str) -> list[tuple[int, ...]]:
    """Where each chunk of ``fqn`` starts in the full tensor, in the newest snapshot."""
    store = open_store(str(root))
    manifest = read_manifest(store, STEPS)
    metadata = parse_metadata(read_object(store, manifest, object_of(manifest, "dcp-", fqn)),
                              fqn)
    return sorted(tuple(c.offsets) for c in metadata.state_dict_metadata[fqn].chunks)


def test_fsdp2_snapshot_of_two_ranks_exported_whole(tmp_path: Path) -> None:
    root, full = train_two_ranks(tmp_path, "fsdp", "--fsdp", "--shard-last-dim1")
    assert saved_chunks(root, "model.0.weight") == [(0, 0), (32, 0)]  # rows: read in place
    assert saved_chunks(root, "model.2.weight") == [(0, 0), (0, 32)]  # columns: copied in

    done = et.export(str(root), tmp_path / "api.pt", format="torch", with_optimizer=True)
    loaded = torch.load(tmp_path / "api.pt", weights_only=True)
    assert done.step == STEPS and loaded["elastictrain"]["world_size"] == 2
    assert loaded["elastictrain"]["snapshot_format"] == "sharded"
    same_tensors(full["model"], loaded["model"])
    same_optimizer(full["optimizer"], loaded["optimizer"])

    fmt = "safetensors" if importlib.util.find_spec("safetensors") else "torch"
    out = tmp_path / f"cli.{fmt}"
    cli = run_cli(["snapshots", "export", str(root), "--format", fmt, "--out", str(out),
                   "--with-optimizer", "--json"], tmp_path, timeout=120)
    assert cli.returncode == 0 and cli.stderr == "", cli.stderr[-3000:]
    assert json.loads(cli.stdout)["step"] == STEPS
    if fmt == "safetensors":
        from safetensors.torch import load_file

        tensors = load_file(out)
        same_tensors(full["model"], {k: v for k, v in tensors.items()
                                     if not k.startswith("optimizer/")})
        for fqn, state in full["optimizer"]["state"].items():
            same_tensors(state, {k: tensors[f"optimizer/state/{fqn}/{k}"] for k in state})
    else:
        same_tensors(full["model"], torch.load(out, weights_only=True)["model"])


def test_ddp_snapshot_of_two_ranks_exported(tmp_path: Path) -> None:
    root, full = train_two_ranks(tmp_path, "ddp")
    et.export(str(root), tmp_path / "m.pt", format="torch", with_optimizer=True)
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert loaded["elastictrain"]["world_size"] == 2
    assert sorted(loaded["model"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    same_tensors(full["model"], loaded["model"])
    same_optimizer(full["optimizer"], loaded["optimizer"])
