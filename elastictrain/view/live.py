"""The live terminal view of a run: one status area redrawn from its event log.

A background thread tails the run's event files (:mod:`elastictrain.view.tail`),
folds them into a :class:`~elastictrain.view.model.RunState` and redraws a
``rich.live.Live`` area a few times per second. It reads files only: no
collective, nothing on the training path. It installs no signal handler, so
Ctrl-C reaches the command as before; :func:`live_view` adds a line saying so.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from elastictrain.runlog.launches import in_launch
from elastictrain.storage.api import Store
from elastictrain.view.model import RunState
from elastictrain.view.output import OutputTail
from elastictrain.view.tail import EventTail

REFRESH_S = 0.25
SHOWN_LINES = 12
_STYLES = {"failure": "bold red", "restart": "yellow", "resume": "green",
           "membership": "magenta", "preempt": "cyan", "memory": "yellow", "end": "bold"}


def view_wanted(stream: IO[str] | None = None, *, json_output: bool = False,
                quiet: bool = False) -> bool:
    """The live view is on for a terminal only, and off with ``--json`` or ``--quiet``."""
    stream = stream or sys.stdout
    return (not json_output and not quiet and stream.isatty()
            and os.environ.get("TERM", "") != "dumb")


def render(state: RunState, title: str, footer: str | None = None,
           now: float | None = None, rows: Sequence[tuple[str, str]] = ()) -> RenderableType:
    """The status area for ``state`` (also used by ``status`` on a terminal); ``rows``:
    more (label, text) rows under the snapshot's."""
    now = now or time.time()
    head = Text.assemble((title, "bold"), f"  attempt {state.attempt}",
                         f"  world size {state.world_size or '?'}",
                         ("  " + state.finished if state.finished else "", "bold"))
    grid = Table.grid(padding=(0, 2))
    grid.add_column(justify="right", style="dim")
    grid.add_column()
    progress = Text(f"step {state.step}" + (f"/{state.total_steps}" if state.total_steps else ""))
    if state.rate is not None:
        progress.append(f"  {state.rate:.1f} steps/s")
        if state.total_steps and state.step < state.total_steps and not state.finished:
            progress.append(f"  ETA {_duration((state.total_steps - state.step) / state.rate)}")
    if state.loss is not None:
        progress.append(f"  {state.loss_text()}")
    if state.total_steps:
        bar = Table.grid(padding=(0, 2))
        bar.add_row(ProgressBar(total=state.total_steps, completed=min(state.step,
                                state.total_steps), width=40), progress)
        grid.add_row("progress", bar)
    else:
        grid.add_row("progress", progress)
    grid.add_row("snapshot", _snapshot_text(state, now))
    for label, text in rows:
        grid.add_row(label, Text(text))
    lines = Table.grid(padding=(0, 1))
    for line in list(state.lines)[-SHOWN_LINES:]:
        stamp = time.strftime("%H:%M:%S", time.localtime(line.ts))
        # Folded, not cut: a failure's log path is to be read whole.
        lines.add_row(Text(stamp, style="dim"), Text(line.text, style=_STYLES.get(line.kind, ""),
                                                     overflow="fold"))
    parts: list[RenderableType] = [head, grid, lines]
    if footer:
        parts.append(Text(footer, style="dim"))
    return Group(*parts)


def _snapshot_text(state: RunState, now: float) -> Text:
    snap = state.last_snapshot
    if snap is None:
        return Text("none committed yet", style="dim")
    text = f"step {snap['step']}"
    if snap.get("tier"):
        text += f" ({snap['tier']})"
    if snap.get("size_bytes"):
        size = int(snap["size_bytes"])
        text += f"  {size / 1e6:.1f} MB" if size >= 100_000 else f"  {size / 1e3:.1f} kB"
    age = state.snapshot_age_s(now)
    if age is not None:
        text += f"  {age:.0f} s ago"
    return Text(text)


class LiveView:
    """Draws a run's state on the terminal until :meth:`stop`.

    Args:
        store: where the run's events are; root: the events directory in it.
        title: the first words of the status area (e.g. "demo <run id>").
        total_steps: the run's target step, for the progress bar (None: step and rate).
        footer: a hint under the area while the job runs (e.g. what Ctrl-C does).
        console: where to draw (default: stdout).
        rows: more (label, text) rows of the area (e.g. where the output goes).
        launch: show only the events of this launch id (``elastictrain.runlog.events``).
        output: the workers' output to print above the area as it comes, where it
            scrolls as on a terminal without a view (``elastictrain run``).
        run_id: named after ``title``, until the events name the run (a relaunch's
            workers adopt the id their storage names: that one is shown then).
    """

    def __init__(self, store: Store, root: str, title: str, total_steps: int | None = None,
                 footer: str | None = None, console: Console | None = None,
                 rows: Sequence[tuple[str, str]] = (), launch: str | None = None,
                 output: OutputTail | None = None, run_id: str | None = None) -> None:
        self.state = RunState(total_steps=total_steps)
        self._run_id = run_id
        self._output = output
        self._tail = EventTail(store, root)
        self._title, self._footer, self._rows, self._launch = title, footer, rows, launch
        self._live = Live(console=console, auto_refresh=False, transient=False,
                          redirect_stdout=False, redirect_stderr=False)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastictrain-view", daemon=True)

    def _heading(self) -> str:
        if self._run_id is None:
            return self._title
        return f"{self._title} {self.state.run_id or self._run_id}"

    def start(self) -> None:
        self._live.start()
        self._thread.start()

    def note(self, text: str, kind: str = "end") -> None:
        """Add a line of the command's own (e.g. "Ctrl-C: stopping the job")."""
        with self._lock:
            self.state._add_line(time.time(), kind, text)
        self._refresh()

    def stop(self) -> None:
        """Read the last events, draw the final state and leave it on the screen."""
        self._done.set()
        self._thread.join(timeout=5)
        self._footer = None  # the hint was for while the job runs
        self._refresh(final=True)
        self._live.stop()

    def _run(self) -> None:
        while not self._done.wait(REFRESH_S):
            self._refresh()

    def _refresh(self, *, final: bool = False) -> None:
        with self._lock:
            if self._output is not None:
                self._print_output(self._output.poll(final=final))
            try:
                for event in self._tail.poll():
                    if self._launch is None or in_launch(event.get("launch_id"), self._launch):
                        self.state.apply(event)
            except OSError:
                pass  # a listing raced a file being created; the next poll sees it
            self._live.update(render(self.state, self._heading(), self._footer, rows=self._rows),
                              refresh=True)

    def _print_output(self, lines: list[str]) -> None:
        """Lines printed while the area is live go above it (rich's ``Live``)."""
        if lines:
            self._live.console.print(Text("\n".join(lines), overflow="fold"), soft_wrap=False)


@contextmanager
def live_view(*, enabled: bool, store: Store, root: str, title: str,
              total_steps: int | None = None, footer: str | None = None,
              launch: str | None = None) -> Iterator[LiveView | None]:
    """A :class:`LiveView` for the block when ``enabled``; Ctrl-C (KeyboardInterrupt)
    is noted on the view and passed on unchanged."""
    if not enabled:
        yield None
        return
    view = LiveView(store, root, title, total_steps, footer, launch=launch)
    view.start()
    try:
        yield view
    except KeyboardInterrupt:
        view.note("Ctrl-C: stopping the job", kind="failure")
        raise
    finally:
        view.stop()


def _duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h10m``: how long the remaining steps take at this rate."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
