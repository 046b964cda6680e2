"""The live view of ``elastictrain run``: the terminal belongs to the view while the job runs.

torchrun's workers inherit the launcher's stdout and stderr, and the launcher's
own log (torchrun's and the agent's) writes there too: any of it would tear a
redrawn status area. So, while the view is on, file descriptors 1 and 2 of the
launcher point at a launcher log file (the workers inherit that), each worker's
output goes to torchrun's per-rank files (``--redirects``/``--log-dir``, unless
the user chose their own), and the view draws on a copy of the terminal's
descriptor. Afterwards both descriptors are put back and a short summary is
printed. The view itself reads the run's event files only (``view.live``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rich.console import Console

from elastictrain.storage import open_store
from elastictrain.view.live import LiveView
from elastictrain.view.model import RunState, attempts_text
from elastictrain.view.output import OutputTail

WORKER_LOGS_DIR = "torchelastic"  # under the run's events dir; the event tail skips it


@dataclass(frozen=True)
class RunOutput:
    """Where the job's output goes while the view is on.

    Args:
        events_dir: the local directory of the run's event files (the view tails it; once
            the launch ended, where they were gathered: a URL on object storage).
        worker_logs: torchrun's ``--log-dir`` (per attempt and rank below it).
        launcher_log: the launcher's stdout and stderr (and unredirected workers').
    """

    events_dir: Path | str
    worker_logs: str
    launcher_log: Path | str

    def rows(self) -> list[tuple[str, str]]:
        """Rows of the view: where to read what it does not show."""
        return [("worker logs", self.worker_logs), ("launcher log", str(self.launcher_log))]


def worker_log_args(given: set[str], log_dir: str | None, events_dir: Path, launch: str
                    ) -> tuple[list[str], str]:
    """torchrun options that send the workers' output to files, and the log dir (one per
    launch: the launches of a run share its events directory).

    ``given`` holds the option names the user set (``launch._given``): their own
    ``--redirects``/``--tee`` and ``--log-dir`` win; only what is unset is added.
    """
    added: list[str] = []
    if not {"redirects", "tee"} & given:
        added.append("--redirects=3")
    if "log_dir" not in given:
        log_dir = str(events_dir / WORKER_LOGS_DIR / launch)
        added.append(f"--log-dir={log_dir}")
    return added, str(log_dir)


@contextmanager
def output_to(path: Path) -> Iterator[IO[str]]:
    """Point this process's stdout and stderr (descriptors 1 and 2, which child processes
    inherit) at ``path``; yield a stream on the former stdout. Both are put back after."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    try:
        yield terminal
    finally:
        terminal.close()
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), saved, strict=True):
            os.dup2(fd, target)
            os.close(fd)


@contextmanager
def run_view(output: RunOutput, run_id: str, launch: str,
             ranks: frozenset[int] | None = frozenset({0})) -> Iterator[LiveView]:
    """The live view of launch ``launch`` of run ``run_id`` while the block runs, with the
    job's output in files (``output``), the new lines of local ranks ``ranks`` (None:
    all) shown under the events. Events of earlier launches of the run (a requeue
    reuses the run id and its events dir) are not shown."""
    Path(output.events_dir).mkdir(parents=True, exist_ok=True)
    with output_to(Path(output.launcher_log)) as terminal:
        view = LiveView(open_store(str(output.events_dir)), "", "elastictrain run",
                        footer="Ctrl-C stops the job: final snapshot, then exit 75",
                        console=Console(file=terminal), rows=output.rows(),
                        launch=launch, output=OutputTail(Path(output.worker_logs), ranks),
                        run_id=run_id)
        view.start()
        try:
            yield view
        finally:
            view.stop()


def summary(state: RunState, exit_code: int, meaning: str, output: RunOutput) -> str:
    """A few lines for under the final view: the outcome, what the run did, where its
    output and events are."""
    newest = state.last_snapshot["step"] if state.last_snapshot else None
    lines = [f"elastictrain run: exit {exit_code}: {meaning}",
             f"  attempts:        {attempts_text(state.attempt)}",
             f"  last step:       {state.step}",
             f"  lost steps:      {state.lost_steps}",
             f"  newest snapshot: {'none' if newest is None else f'step {newest}'}"]
    if state.final_snapshot is not None:
        lines.append(f"  final snapshot:  step {state.final_snapshot}")
    lines += [f"  worker output:   {output.worker_logs}",
              f"  launcher log:    {output.launcher_log}",
              f"  events:          {output.events_dir}"]
    return "\n".join(lines)
