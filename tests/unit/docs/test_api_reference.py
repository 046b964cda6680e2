"""The API reference builds from the docstrings (scripts/build_api_docs.py, pdoc) with
no warning, and documents every public name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.helpers import REPO

pytest.importorskip("pdoc", reason="needs pdoc (the test extra)")


def test_the_api_reference_builds_and_names_every_public_name(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("build_api_docs",
                                                  REPO / "scripts" / "build_api_docs.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.build(tmp_path) == []
    page = (tmp_path / "elastictrain.html").read_text(encoding="utf-8")
    assert 'id="SnapshotManager"' in page and 'id="init"' in page
