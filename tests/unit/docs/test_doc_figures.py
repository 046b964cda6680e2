"""The measured figures the docs show are the saved reports' figures: each marked block
is regenerated from its JSON by the benchmark's replay (scripts/doc_figures.py) and
compared with the page."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import doc_figures


def test_every_marked_block_matches_its_report() -> None:
    assert doc_figures.count_blocks() >= 13
    found = doc_figures.differences()
    assert not found, "\n\n".join(found) + "\n(python scripts/doc_figures.py --write)"


def test_every_saved_report_in_docs_is_shown_through_a_marked_block() -> None:
    marked = " ".join(block.command for page in doc_figures.PAGES
                      for block in doc_figures.marked_blocks(page, page.read_text()))
    reports = {p.name for p in (REPO / "docs").glob("bench-*.json")} | {"gpu-checks-h200.json"}
    # The snapshot curve's report is drawn (a PNG), not tabled.
    quoted = {"bench-snapshot-curve.json"}
    assert {name for name in reports - quoted if name not in marked} == set()


def test_a_changed_figure_is_found_and_written_back(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    original = (REPO / "docs" / "scale.md").read_text()
    page.write_text(original.replace("| 2 | 2.86 s |", "| 2 | 2.85 s |", 1))
    [diff] = doc_figures.differences([page])
    assert "-| 2 | 2.85 s |" in diff and "+| 2 | 2.86 s |" in diff
    assert doc_figures.differences([page], write=True) == []
    assert page.read_text() == original


def test_a_marker_must_name_a_replay_and_precede_a_block(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- figures: scripts/bench_scale.py --sizes 2 -->\n| a |\n")
    with pytest.raises(ValueError, match="only a replay"):
        doc_figures.differences([page])
    page.write_text("<!-- figures: scripts/bench_scale.py --table x.json -->\ntext\n")
    with pytest.raises(ValueError, match="not followed by a fenced block or a table"):
        doc_figures.differences([page])
