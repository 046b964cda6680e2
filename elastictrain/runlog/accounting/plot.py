"""Draw a run's split: one lane per attempt on a shared time axis, and a bar of the
split. Needs matplotlib (``pip install 'elastictrain[plot]'``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastictrain.core.errors import ConfigError
from elastictrain.runlog.accounting.split import CAUSES, Split

COLORS = {"productive": "#2e7d32", "lost_work": "#e53935", "snapshot_blocking": "#1e88e5",
          "restore": "#8e24aa", "restart": "#9e9e9e", "between_launches": "#e0e0e0",
          "preempt_drain": "#fb8c00",
          "hang": "#6d4c41", "suspect": "#ad1457"}
LABELS = {"productive": "productive", "lost_work": "lost work",
          "snapshot_blocking": "snapshot blocking", "restore": "restore",
          "restart": "restart / start-up", "between_launches": "between launches",
          "preempt_drain": "preemption drain",
          "hang": "hang (watchdog)", "suspect": "suspect restore"}
_TIER_MARKERS = {"durable": "v", "memory": "^"}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on training nodes
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed; fix: pip install "
            "'elastictrain[plot]' (or pip install matplotlib)") from None
    return plt


def plot_split(split: Split, path: str | Path) -> Path:
    """Write the timeline and the split bar of ``split`` to ``path`` (PNG, SVG, PDF).

    Raises:
        ConfigError: matplotlib is missing, or the file cannot be written (names it).
    """
    plt = _pyplot()
    fig = draw_split(split)
    out = Path(path)
    try:
        fig.savefig(out, dpi=110, bbox_inches="tight")
    except OSError as exc:
        raise ConfigError(f"--plot {str(out)!r}: cannot write it ({exc.strerror}); fix: "
                          "pass a path in a writable directory") from None
    finally:
        plt.close(fig)
    return out


def draw_split(split: Split) -> Any:
    """The figure of ``split`` (a matplotlib ``Figure``; the caller closes it)."""
    plt = _pyplot()
    lanes = max(len(split.attempts), 1)
    # Heights in inches: every lane as tall whatever their number, the share bar fixed;
    # the constrained layout makes room for the labels and the legend below.
    lane_in, bar_in = 0.55, 0.45
    fig = plt.figure(figsize=(11, 2.4 + lane_in * lanes + bar_in), layout="constrained")
    timeline, bar = fig.subplots(2, 1, height_ratios=[lane_in * lanes, bar_in])
    for lane, attempt in enumerate(split.attempts):
        y = lanes - 1 - lane
        for cause in CAUSES:
            ranges = [(s.start - split.start, s.seconds) for s in attempt.spans
                      if s.cause == cause]
            if ranges:
                timeline.broken_barh(ranges, (y - 0.35, 0.7), color=COLORS[cause])
        for ts, _step, tier in attempt.commits:
            timeline.plot(ts - split.start, y + 0.45, marker=_TIER_MARKERS.get(tier, "v"),
                          color="black", markersize=5, linestyle="none")
        if attempt.ended_by != "finished":
            timeline.plot(attempt.end - split.start, y, marker="X", color="black",
                          markersize=9, linestyle="none")
        timeline.annotate(attempt.ended_by, (attempt.end - split.start, y - 0.45),
                          fontsize=8, ha="right", va="top")
    timeline.set_yticks(range(len(split.attempts)))
    timeline.set_yticklabels([f"attempt {a.index}\nsteps {a.from_step or 0}-{a.to_step}"
                              for a in reversed(split.attempts)], fontsize=8)
    timeline.set_ylim(-0.8, len(split.attempts) - 0.2)
    timeline.set_xlim(0, split.wall_s)
    timeline.set_xlabel("seconds since the run started (▼ snapshot committed, X failure)")
    wall = split.wall_s or 1.0
    left = 0.0
    for cause in CAUSES:
        share = split.seconds[cause] / wall
        if share <= 0:
            continue
        bar.barh(0, share, left=left, color=COLORS[cause],
                 label=f"{LABELS[cause]} {share:.1%}")
        left += share
    bar.set_xlim(0, 1)
    bar.set_yticks([])
    bar.set_xlabel(f"share of {split.wall_s:.1f}s wall time")
    handles, labels = bar.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8,
               frameon=False)
    fig.suptitle(f"where the time went: goodput {split.seconds['productive'] / wall:.1%}")
    return fig
