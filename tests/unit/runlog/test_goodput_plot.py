"""The goodput plot is laid out for any number of attempts: no warning from matplotlib,
no two labels of the time line over each other, the legend clear of the axis labels
(1, 2 and 20 attempts; the pictures were looked at too)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from elastictrain.runlog.accounting.plot import draw_split
from elastictrain.runlog.accounting.split import split_run

plt = pytest.importorskip("matplotlib.pyplot", reason="needs matplotlib (the plot extra)")


def _ev(name: str, ts: float, step: int | None = 0, **fields: Any) -> dict[str, Any]:
    return {"event": name, "ts": ts, "step": step, **fields}


def _run(events: Path, attempts: int) -> Path:
    """``attempts`` attempts of 9 s, each killed after its snapshot but the last."""
    events.mkdir()
    agent = [_ev("agent.start", 0.0, None)]
    step = 0
    for a in range(attempts):
        t = 9.0 * a
        lines = [_ev("worker.start", t + 1), _ev("resume", t + 3, step,
                                                  from_step=step or None, lost_steps=0)]
        step += 20
        lines += [_ev("snapshot.staged", t + 6, step, snapshot_step=step, duration_s=0.3),
                  _ev("snapshot.committed", t + 6, step, snapshot_step=step)]
        if a == attempts - 1:
            lines.append(_ev("run.finished", t + 8, step + 2))
        else:
            agent.append(_ev("agent.worker_failed", t + 8.2, None, signal="SIGKILL",
                             exit_code=-9))
        (events / f"attempt{a:03d}-rank0.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in lines))
    agent.append(_ev("agent.finished", 9.0 * attempts, None))
    (events / "agent-h.jsonl").write_text("".join(json.dumps(e) + "\n" for e in agent))
    return events


def _overlap(a: Any, b: Any) -> bool:
    return bool(a.width and b.width and a.overlaps(b))


@pytest.mark.parametrize("attempts", [1, 2, 20])
def test_the_plot_is_laid_out(tmp_path: Path, attempts: int) -> None:
    split = split_run(_run(tmp_path / "events", attempts))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Tight layout not applied" and the like
        fig = draw_split(split)
        fig.canvas.draw()
    try:
        timeline, bar = fig.axes
        renderer = fig.canvas.get_renderer()
        ticks = [t.get_window_extent(renderer) for t in timeline.get_yticklabels()]
        assert len(ticks) == attempts
        assert not any(_overlap(a, b) for i, a in enumerate(ticks) for b in ticks[i + 1:])
        (legend,) = fig.legends
        box = legend.get_window_extent(renderer)
        for label in (bar.xaxis.label, timeline.xaxis.label):
            assert not _overlap(box, label.get_window_extent(renderer))
        assert not _overlap(timeline.get_tightbbox(renderer), bar.get_window_extent(renderer))
    finally:
        plt.close(fig)
