"""Restore from S3 on 2 ranks: bytes read from the object store and peak memory per rank.

The two restore modes of the same snapshot in the same run, on moto's S3 server
(started here on 127.0.0.1 at a free port, stopped by PID):

- ``each``: every rank reads the payload from storage (the baseline);
- ``broadcast``: rank 0 reads and verifies, the others receive over gloo
  (the default on object stores, ``restore_mode=auto``).

Each repetition is two fresh processes (a gloo group of 2), so neither the server
nor the writer's copy of the state is counted. Per rank it measures the bytes read
through the store (a counting wrapper), the peak resident-set growth during
``load_newest`` (VmHWM, reset just before), and the wall time. Ratios are per
repetition, reported as median [min-max]:

    python scripts/bench_restore_s3.py --size-mb 192 --rounds 3 [--json [FILE]]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_s3 import free_port, moto_server
from benchlib import fmt, load_average, ratio_spread, spread, write_json

from elastictrain.snapshot.durable.commit import persist_snapshot
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.storage import FsspecStore
from elastictrain.storage.api import Store

MIB = 1024 * 1024
BUCKET = "bench-restore"
MODES = ("each", "broadcast")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=192, help="state size in MiB (default 192)")
    p.add_argument("--rounds", type=int, default=3, help="repetitions per mode (default 3)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the report as JSON to FILE (no FILE or -: stdout)")
    p.add_argument("--worker", nargs=4, metavar=("ENDPOINT", "MODE", "RANK", "PORT"),
                   help=argparse.SUPPRESS)  # one rank of one repetition (internal)
    return p.parse_args(argv)


def _options(endpoint: str) -> dict[str, Any]:
    # moto accepts any credentials; these are placeholders, not secrets.
    return {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint}}


class _CountingReader:
    """A read stream that adds what it returns to a counter (not a ``BinaryIO``
    subclass: its stub methods would shadow the inner stream's)."""

    def __init__(self, inner: BinaryIO, counter: list[int]) -> None:
        self._inner, self._counter = inner, counter

    def read(self, n: int = -1) -> bytes:
        data = self._inner.read(n)
        self._counter[0] += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        n = self._inner.readinto(buffer)  # type: ignore[attr-defined]
        self._counter[0] += n or 0
        return int(n or 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ReadCountingStore:
    """Forwards to a Store and counts the payload bytes read through it."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.counter = [0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def read_bytes(self, path: str) -> bytes:
        data = self.inner.read_bytes(path)
        self.counter[0] += len(data)
        return data

    def read_into(self, path: str, buffer: Any, offset: int = 0, *,
                  object_size: int | None = None) -> int:
        n = self.inner.read_into(path, buffer, offset, object_size=object_size)
        self.counter[0] += n
        return n

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with self.inner.open_read(path) as stream:
            yield _CountingReader(stream, self.counter)  # type: ignore[misc]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def worker(endpoint: str, mode: str, rank: int, port: int) -> None:
    """One rank: restore the newest snapshot; print bytes read, peak growth and time."""
    import torch.distributed as dist

    from elastictrain.snapshot.durable.restore import load_newest
    from elastictrain.snapshot.format.reader import read_manifest
    from elastictrain.worker.dist import DistContext

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ctx = DistContext(rank, 2, rank, "gloo", torch.device("cpu"), True)
    store = ReadCountingStore(FsspecStore(f"s3://{BUCKET}/run", _options(endpoint)))
    read_manifest(store, 1)  # warm up clients and connections before the baseline
    dist.barrier()
    store.counter[0] = 0
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    baseline = _status_kib("VmRSS")
    started = time.perf_counter()
    loaded = load_newest(store, ctx, mode)
    elapsed = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    assert loaded is not None and loaded.step == 1
    print(json.dumps({"rank": rank, "bytes_read": store.counter[0], "wall_s": elapsed,
                      "peak_growth_bytes": (peak - baseline) * 1024}))
    dist.destroy_process_group()


def plant(endpoint: str, size_mb: float) -> int:
    """A committed step-1 snapshot of ``size_mb`` of float32 tensors; returns its bytes."""
    import s3fs

    s3fs.S3FileSystem(**_options(endpoint)).mkdir(BUCKET)
    per = int(size_mb * MIB) // 4 // 16
    state = {f"w{i}": torch.randn(per) for i in range(16)}
    store = FsspecStore(f"s3://{BUCKET}/run", _options(endpoint))
    meta = SnapshotMeta(run_id="bench", step=1, epoch=0, world_size=2, checksum_algorithm="crc32")
    manifest = persist_snapshot(store, {"model": state}, meta)
    assert manifest is not None
    return manifest.total_bytes


def one_round(endpoint: str, mode: str) -> list[dict[str, Any]]:
    """Both ranks of one repetition, each a fresh process."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", endpoint, mode, str(rank),
                               str(port)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for rank in range(2)]
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"restore worker exited {proc.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return sorted(results, key=lambda r: r["rank"])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    load_before = load_average()
    with moto_server() as endpoint:
        state_bytes = plant(endpoint, args.size_mb)
        runs: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:  # interleaved, so drift hits both modes alike
                runs[mode].append(one_round(endpoint, mode))
    per_mode: dict[str, Any] = {}
    for mode, rounds in runs.items():
        egress = [sum(r["bytes_read"] for r in ranks) / state_bytes for ranks in rounds]
        per_mode[mode] = {
            "egress_over_state": spread(egress),
            "wall_s": spread([max(r["wall_s"] for r in ranks) for ranks in rounds]),
            **{f"rank{k}_peak_over_state": spread([ranks[k]["peak_growth_bytes"] / state_bytes
                                                    for ranks in rounds]) for k in range(2)},
            **{f"rank{k}_peak_over_state_mib": spread(
                [(ranks[k]["peak_growth_bytes"] - state_bytes) / MIB for ranks in rounds])
               for k in range(2)},
        }
    each_egress = [sum(r["bytes_read"] for r in ranks) for ranks in runs["each"]]
    bcast_egress = [sum(r["bytes_read"] for r in ranks) for ranks in runs["broadcast"]]
    return {
        "size_mb": args.size_mb, "state_bytes": state_bytes, "rounds": args.rounds,
        "modes": per_mode,
        "broadcast_vs_each_egress": ratio_spread(bcast_egress, each_egress),
        "broadcast_vs_each_wall": ratio_spread(
            [max(r["wall_s"] for r in ranks) for ranks in runs["broadcast"]],
            [max(r["wall_s"] for r in ranks) for ranks in runs["each"]]),
        "load_average": [round(load_before, 2), round(load_average(), 2)],
        "cpus": os.cpu_count(),
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"restore from S3 (moto), 2 ranks, {report['state_bytes'] / MIB:.0f} MiB state, "
          f"{report['rounds']} rounds; load average {report['load_average']}")
    print(f"{'mode':<10} {'S3 bytes read / state':>22} {'rank 0 peak / state':>20} "
          f"{'rank 1 peak / state':>20} {'wall s':>16}  (peak = RSS growth while loading)")
    for mode, m in report["modes"].items():
        print(f"{mode:<10} {fmt(m['egress_over_state'], 2):>22} "
              f"{fmt(m['rank0_peak_over_state'], 2):>20} {fmt(m['rank1_peak_over_state'], 2):>20} "
              f"{fmt(m['wall_s'], 2):>16}")
    for mode, m in report["modes"].items():
        above = [fmt(m[f"rank{k}_peak_over_state_mib"], 1) for k in range(2)]
        print(f"{mode}: peak above one copy of the state, MiB: rank 0 {above[0]}, "
              f"rank 1 {above[1]}")
    print(f"broadcast / each: egress {fmt(report['broadcast_vs_each_egress'], 2)}, "
          f"wall {fmt(report['broadcast_vs_each_wall'], 2)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        endpoint, mode, rank, port = args.worker
        worker(endpoint, mode, int(rank), int(port))
        return 0
    with contextlib.redirect_stdout(sys.stderr) if args.json == "-" else contextlib.nullcontext():
        report = measure(args)
        print_table(report)
    if args.json is not None:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
