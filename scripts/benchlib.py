"""What every benchmark here shares: spread of repeated figures, the noise probes,
and the curve's JSON and plot.

One copy, imported by ``bench_snapshot.py``, ``bench_s3.py`` and ``bench_recovery.py``
(run them from the repository root or with ``scripts/`` on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Above this 1-minute load average per core, or below this busy-loop ratio, a run is noisy.
NOISY_LOAD_PER_CPU = 0.75
NOISY_BUSY_LOOP_RATIO = 0.9


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements (the median is the figure quoted)."""
    if not values:
        raise ValueError("spread of no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def ratio_spread(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, float]:
    """``median(numerator) / median(denominator)`` with its extremes: the lowest and
    highest ratio the two sets of measurements allow."""
    return spreads_ratio(spread(numerator), spread(denominator))


def spreads_ratio(num: dict[str, float], den: dict[str, float]) -> dict[str, float]:
    """``ratio_spread`` of two spreads already taken (a saved report's)."""
    return {"median": num["median"] / den["median"], "min": num["min"] / den["max"],
            "max": num["max"] / den["min"]}


def fmt(s: dict[str, float], digits: int = 3) -> str:
    """``median [min-max]``."""
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def busy_loop_ratio(work: Callable[[], None], repeats: int = 6) -> float:
    """Rate of ``work`` with a pure busy-loop process beside it over the rate without:
    about 1.0 when a core is really free, about 0.5 when other work already uses it."""
    return _ratio_beside(work, "print('ready', flush=True)\nwhile True: pass", repeats)


def memory_copy_ratio(work: Callable[[], None], mib: int, repeats: int = 6) -> float:
    """Rate of ``work`` with a process beside it that copies a ``mib`` MiB buffer into
    another in a loop (one thread, a plain ``memmove`` per copy) over the rate without:
    what a stream of memory traffic on the other core costs ``work`` on this host, with
    no file, no lock and no interpreter in common: the floor under a persist that copies
    and checksums the state while ``work`` runs. The process imports nothing, so it is
    ready in a fraction of a second."""
    code = (f"a = bytearray(b'\\1' * ({mib} << 20))\nb = bytearray(len(a))\n"
            "b[:] = a\nprint('ready', flush=True)\nwhile True: b[:] = a")
    return _ratio_beside(work, code, repeats)


def _ratio_beside(work: Callable[[], None], code: str, repeats: int) -> float:
    """Rate of ``work`` beside a process running ``code`` over the rate without; the
    process says ``ready`` once its loop is about to start (measured from then)."""
    def rate() -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            work()
        return repeats / (time.perf_counter() - started)

    alone = rate()
    hog = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ready"
        with_hog = rate()
    finally:
        hog.kill()
        hog.wait()
    return with_hog / alone


def noisy(load_before: float, load_after: float, busy_ratio: float | None) -> bool:
    """Whether other work on the machine makes the run's figures unreliable."""
    cpus = os.cpu_count() or 1
    loaded = max(load_before, load_after) > NOISY_LOAD_PER_CPU * cpus
    return loaded or (busy_ratio is not None and busy_ratio < NOISY_BUSY_LOOP_RATIO)


def write_json(path: str, report: Any) -> None:
    """Write the report (``-``: stdout)."""
    text = json.dumps(report, indent=1)
    if path == "-":
        print(text, flush=True)
    else:
        Path(path).write_text(text + "\n")


def plot_curve(path: str, title: str, sizes_mb: Sequence[float],
               series: dict[str, Sequence[dict[str, float]]], ylabel: str) -> None:
    """Draw each series' median against state size, with min-max error bars, to a PNG.

    Raises:
        SystemExit: matplotlib is missing (it is the optional ``plot`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"--plot {path}: matplotlib is not installed; fix: "
                         "pip install 'elastictrain[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        medians = [p["median"] for p in points]
        low = [p["median"] - p["min"] for p in points]
        high = [p["max"] - p["median"] for p in points]
        ax.errorbar(sizes_mb, medians, yerr=[low, high], marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("state size (MB)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class CallTimer:
    """Times every call of one method of one object, from the benchmark's side: the
    method is replaced on that instance by a wrapper (callers that look it up at call
    time, as hooks do, go through it). ``total_s`` sums the calls' durations; ``calls``
    counts them and ``last_started`` is when the latest one began (perf_counter)."""

    def __init__(self, owner: Any, name: str) -> None:
        self.total_s = 0.0
        self.calls = 0
        self.last_started: float | None = None
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            self.calls += 1
            self.last_started = started
            try:
                return inner(*args, **kwargs)
            finally:
                self.total_s += time.perf_counter() - started

        setattr(owner, name, timed)


def events_named(directory: Path, name: str) -> list[dict[str, Any]]:
    """Every event called ``name`` in the JSON-lines files anywhere below ``directory``
    (a run's agents' and workers' event files), file by file in name order."""
    from elastictrain.runlog.events_read import read_events

    return [event for path in sorted(directory.rglob("*.jsonl"))
            for event in read_events(path) if event.get("event") == name]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous or a test server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object a benchmark's worker wrote, or None while it is missing or torn."""
    try:
        return dict(json.loads(path.read_text()))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def rounded(obj: Any, digits: int) -> Any:
    """``obj`` with every float in it (through dicts and lists) rounded, for a report."""
    if isinstance(obj, float):
        return round(obj, digits)
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rounded(v, digits) for v in obj]
    return obj

