"""scripts/bench_export.py end to end at a small size (a replicated snapshot, one round):
its JSON figures present and sane: the naive ``torch.load`` grows by about the model,
the export by the largest tensor and its buffers, well below."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = [pytest.mark.bench,
              pytest.mark.skipif(importlib.util.find_spec("safetensors") is None,
                                 reason="needs [safetensors]")]


def test_small_run_reports_the_export_against_the_naive_ways() -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_export.py"),
                           "--size-mb", "64", "--width", "512", "--rounds", "1",
                           "--kinds", "replicated", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    figures = report["kinds"]["replicated"]
    assert 0.9 < figures["naive-torch"]["growth_over_model"]["median"] < 1.5
    for method in ("export-safetensors", "export-torch"):  # 1 MiB tensors, 8 MiB buffer
        assert figures[method]["growth_over_model"]["median"] < 0.5, figures[method]
        assert figures[method]["duration_s"]["median"] > 0
    assert report["setup"]["largest_tensor_mib"] == 1 and len(report["load"]) == 1
