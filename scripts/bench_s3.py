"""Persist and restore throughput on S3: elastictrain versus raw s3fs on the same bytes.

One run, one server (a moto server this script starts on 127.0.0.1 at a free port
and stops, or any S3 endpoint with ``--endpoint``), a state of ``--size-mb``:

* ``raw put``: s3fs ``pipe_file`` of the serialised state's bytes (s3fs sends one
  PUT below 100 MB);
* ``persist``: elastictrain's ``persist_snapshot`` of the state: ``torch.save``
  streamed into a multipart upload, checksummed, then the manifest PUT;
* ``raw get``: s3fs ``cat_file`` of those bytes;
* ``boto3 put`` / ``boto3 get``: the same bytes through boto3's transfer manager
  with its own defaults (10 threads, 8 MiB parts and ranges, multipart above 8 MiB),
  and ``boto3 tuned put`` with elastictrain's settings (threshold, part size,
  concurrency): raw baselines that show where the server (moto: one Python process)
  is the limit. ``persist_vs_best_raw_put`` compares persist with the fastest of the
  three raw uploads, ``restore_vs_best_raw_get`` restore with the faster raw read;
* the persist's own parts, timed alone in the same rounds: ``serialize`` (``torch.save``
  of the state, checksummed, into a sink that keeps nothing) and ``commit_requests``
  (the manifest lookup that finds nothing, and a small PUT the size of a manifest).
  ``persist_floor_s`` is the best raw upload plus those two: a single PUT is sent
  only once the state is serialised (the client signs the whole body), so below the
  multipart threshold they add up, and ``persist_vs_floor`` says how close the persist
  comes to that;
* ``restore``: discovery (fresh listing, manifest) and the verified read (size and
  checksum) of the payload: the storage work. ``restore_with_load`` is the whole restore:
  ``torch.load`` streams the payload while its size and checksum are checked on the
  same reads (``restore_with_load_vs_raw_get``).

Rounds interleave raw and elastictrain so that load on a shared machine hits both;
times are medians with [min-max]. Ratios are elastictrain's throughput over raw's (1.0 = as fast as
a bare PUT/GET of the same bytes; the target is >= 0.9). A separate, untimed round
measures peak Python memory (tracemalloc) of persist and of a raw put, beyond the
state itself, and every timed operation's CPU seconds, in this process and in the
moto server's: CPU is what a loaded machine distorts least, and on two cores the
server's CPU is what bounds a persist. Numbers on a loaded 2-core box are noisy:
compare ratios from one run.

    python scripts/bench_s3.py [--sizes 48 512] [--rounds 5] [--json [FILE]] [--plot FILE.png]
    python scripts/bench_s3.py --endpoint http://127.0.0.1:9000 --bucket b  # MinIO…
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import statistics
import subprocess
import sys
import time
import tracemalloc
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from benchlib import (
    busy_loop_ratio,
    fmt,
    free_port,
    load_average,
    noisy,
    plot_curve,
    ratio_spread,
    spread,
    write_json,
)

from elastictrain.core import layout
from elastictrain.core import log as et_log
from elastictrain.core.config import StorageConfig
from elastictrain.core.errors import StorageNotFoundError
from elastictrain.snapshot.durable.commit import persist_snapshot, serialize_payload
from elastictrain.snapshot.durable.retention import prune
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.snapshot.format.reader import newest_first, verify_snapshot
from elastictrain.storage import open_store

MB = 1e6
MIB = 2**20


class NullSink(io.RawIOBase):
    """A writable stream that keeps nothing: what serialising alone costs."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = StorageConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", "--size-mb", dest="sizes", type=float, nargs="+", default=[48.0],
                   help="state sizes in MB, one run each (default 48)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--part-size-mb", type=float, default=defaults.part_size_bytes / MIB)
    p.add_argument("--multipart-threshold-mb", type=float,
                   default=defaults.multipart_threshold_bytes / MIB,
                   help="states up to this go in one PUT (5: stream everything)")
    p.add_argument("--concurrency", type=int, default=defaults.upload_concurrency)
    p.add_argument("--endpoint", default=None, help="an S3 endpoint (default: start moto)")
    p.add_argument("--bucket", default="elastictrain-bench")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the curve as JSON to FILE (no FILE or -: stdout)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the curve")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error(f"--rounds {args.rounds}: at least 3 (medians of fewer say nothing)")
    for size in args.sizes:
        if size <= 0:
            p.error(f"--sizes {size:g}: every size must be > 0 MB")
    return args


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server as a child process; yields its endpoint."""
    with moto_process() as (endpoint, _):
        yield endpoint


@contextmanager
def moto_process() -> Iterator[tuple[str, int]]:
    """moto's S3 server as a child process (its own GIL), stopped by PID at the end."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        yield endpoint, proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def make_state(size_mb: float, n_params: int = 100) -> dict[str, Any]:
    """Shaped like a model with AdamW: ``n_params`` weights, and per weight an
    ``exp_avg``, an ``exp_avg_sq`` and a step counter (about 400 tensors)."""
    per = int(size_mb * MB) // 4 // 3 // n_params
    model = {f"layer{i}.weight": torch.randn(per) for i in range(n_params)}
    state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(per),
                 "exp_avg_sq": torch.rand(per)} for i in range(n_params)}
    optimizer = {"state": state, "param_groups": [{"lr": 1e-3, "params": list(range(n_params))}]}
    return {"model": model, "optimizer": optimizer, "step": 1}


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def peak_python_bytes(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def boto3_client(endpoint: str, options: dict[str, Any]) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=options.get("key"),
                        aws_secret_access_key=options.get("secret"))


def server_cpu_s(pid: int | None) -> float:
    """CPU seconds the server process has used (0 for a server not started here)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args: argparse.Namespace, endpoint: str, size_mb: float,
        server_pid: int | None) -> dict[str, Any]:
    from boto3.s3.transfer import TransferConfig

    load_before = load_average()
    options: dict[str, Any] = {"client_kwargs": {"endpoint_url": endpoint}}
    if not os.environ.get("AWS_ACCESS_KEY_ID"):
        options.update(key="bench", secret="bench")  # moto accepts anything
    config = StorageConfig(url=f"s3://{args.bucket}/bench", storage_options=options,
                           part_size_bytes=int(args.part_size_mb * MIB),
                           multipart_threshold_bytes=int(args.multipart_threshold_mb * MIB),
                           upload_concurrency=args.concurrency)
    store = open_store(config)
    fs = store.fs
    if not fs.exists(args.bucket):
        fs.mkdir(args.bucket)  # no region: moto rejects a location constraint
    state = make_state(size_mb)
    buf = io.BytesIO()
    serialize_payload(state, buf, "crc32")
    raw = buf.getvalue()
    raw_key = f"{args.bucket}/bench-raw/state.pt"
    client = boto3_client(endpoint, options)
    tuned = TransferConfig(multipart_threshold=config.multipart_threshold_bytes,
                           multipart_chunksize=config.part_size_bytes,
                           max_concurrency=args.concurrency)
    boto_key = "bench-raw/boto3.pt"

    def boto3_put(transfer: TransferConfig | None = None) -> None:
        client.upload_fileobj(io.BytesIO(raw), args.bucket, boto_key,
                              Config=transfer or TransferConfig())

    def boto3_get() -> None:
        out = io.BytesIO()
        client.download_fileobj(args.bucket, boto_key, out, Config=TransferConfig())
        assert out.getbuffer().nbytes == len(raw)
    step = 0

    def persist() -> None:
        nonlocal step
        step += 1
        meta = SnapshotMeta(run_id="bench", step=step, epoch=0, world_size=1,
                            checksum_algorithm="crc32")
        persist_snapshot(store, state, meta)

    def serialize() -> None:
        serialize_payload(state, NullSink(), "crc32")

    def commit_requests() -> None:
        with contextlib.suppress(StorageNotFoundError):
            store.read_bytes("bench-floor/absent/manifest.json")
        store.write_bytes("bench-floor/manifest.json", b"m" * manifest_bytes)

    def restore(load: bool = False) -> None:
        """Discovery (fresh listing, manifest) and the verified read (the storage work);
        with ``load``, deserialized on the same streamed reads (a whole restore)."""
        newest = next(c for c in newest_first(store) if c.manifest is not None)
        found = verify_snapshot(store, newest.step, manifest=newest.manifest, load=load)
        assert found.manifest.total_bytes == len(raw)

    ops: dict[str, Callable[[], Any]] = {
        "raw_put": lambda: fs.pipe_file(raw_key, raw), "boto3_put": boto3_put,
        "boto3_tuned_put": lambda: boto3_put(tuned), "persist": persist,
        "serialize": serialize, "commit_requests": commit_requests,
        "raw_get": lambda: fs.cat_file(raw_key), "boto3_get": boto3_get,
        "restore": restore, "restore_with_load": lambda: restore(load=True)}
    times: dict[str, list[float]] = {name: [] for name in ops}
    cpu: dict[str, list[float]] = {name: [] for name in ops}
    server_cpu: dict[str, list[float]] = {name: [] for name in ops}
    persist()
    manifest_bytes = len(store.read_bytes(f"{layout.step_dir(step)}/{layout.MANIFEST}"))
    restore()
    fs.pipe_file(raw_key, raw)  # warm-up: connections, credentials, code paths
    boto3_put()
    free_core = busy_loop_ratio(lambda: fs.cat_file(raw_key), repeats=3)
    for _ in range(args.rounds):
        for name, op in ops.items():
            cpu_before, server_before = time.process_time(), server_cpu_s(server_pid)
            times[name].append(timed(op))
            cpu[name].append(time.process_time() - cpu_before)
            server_cpu[name].append(server_cpu_s(server_pid) - server_before)
        prune(store, keep=1, newest_step=step)  # keep the server's memory flat
    peaks = {"persist_peak_python_bytes": peak_python_bytes(persist),
             "raw_put_peak_python_bytes": peak_python_bytes(lambda: fs.pipe_file(raw_key, raw))}
    fs.rm(f"{args.bucket}/bench-raw", recursive=True)
    store.delete("", recursive=True)
    load_after = load_average()
    probe: dict[str, Any] = {"load_avg_before": load_before, "load_avg_after": load_after,
             "get_rate_ratio_with_busy_loop": round(free_core, 3),
             "noisy": noisy(load_before, load_after, free_core)}
    probe["cpu_s"] = {k: round(statistics.median(v), 3) for k, v in cpu.items()}
    if server_pid is not None:
        probe["server_cpu_s"] = {k: round(statistics.median(v), 3)
                                 for k, v in server_cpu.items()}
    return summarize(args, endpoint, len(raw), times, peaks, probe)


def summarize(args: argparse.Namespace, endpoint: str, size: int,
              times: dict[str, list[float]], peaks: dict[str, int],
              probe: dict[str, Any]) -> dict[str, Any]:
    median = {k: statistics.median(v) for k, v in times.items()}
    best_put = min(median["raw_put"], median["boto3_put"], median["boto3_tuned_put"])
    floor = best_put + median["serialize"] + median["commit_requests"]
    mb_s = {k: round(size / MB / v, 1) for k, v in median.items() }
    return {
        **probe,
        "endpoint": endpoint, "size_bytes": size, "rounds": args.rounds,
        "part_size_bytes": int(args.part_size_mb * MIB), "upload_concurrency": args.concurrency,
        "multipart_threshold_bytes": int(args.multipart_threshold_mb * MIB),
        "persist_upload": "multipart" if size > args.multipart_threshold_mb * MIB else "one PUT",
        **{f"{k}_s": round(v, 4) for k, v in median.items()},
        **{f"{k}_mb_s": v for k, v in mb_s.items()},
        "persist_vs_raw_put": round(median["raw_put"] / median["persist"], 3),
        "restore_vs_raw_get": round(median["raw_get"] / median["restore"], 3),
        "spread_s": {k: spread(v) for k, v in times.items()},
        "persist_vs_raw_put_spread": ratio_spread(times["raw_put"], times["persist"]),
        "restore_vs_raw_get_spread": ratio_spread(times["raw_get"], times["restore"]),
        "persist_vs_boto3_put": round(median["boto3_put"] / median["persist"], 3),
        "persist_vs_boto3_tuned_put": round(median["boto3_tuned_put"] / median["persist"], 3),
        "restore_vs_boto3_get": round(median["boto3_get"] / median["restore"], 3),
        "persist_vs_best_raw_put": round(best_put / median["persist"], 3),
        "persist_floor_s": round(floor, 4),
        "persist_vs_floor": round(floor / median["persist"], 3),
        "restore_vs_best_raw_get": round(min(median["raw_get"], median["boto3_get"])
                                         / median["restore"], 3),
        "persist_peak_bytes_over_state": round(peaks["persist_peak_python_bytes"] / size, 3),
        "restore_with_load_vs_raw_get": round(
            median["raw_get"] / median["restore_with_load"], 3),
        **peaks,
        "all_times_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }


def table(r: dict[str, Any]) -> str:
    sp = r["spread_s"]
    cpu, server = r["cpu_s"], r.get("server_cpu_s", {})

    def cpus(key: str) -> str:
        return f"{cpu[key]:6.2f} {server[key]:6.2f}" if server else f"{cpu[key]:6.2f} {'':6}"
    lines = [
        f"elastictrain S3 bench: {r['size_bytes'] / MB:.1f} MB state at {r['endpoint']}, "
        f"median of {r['rounds']} rounds; persist as {r['persist_upload']} (threshold "
        f"{r['multipart_threshold_bytes'] / MIB:g} MiB, parts {r['part_size_bytes'] / MIB:g} MiB"
        f" x {r['upload_concurrency']})",
        f"load average before/after {r['load_avg_before']:.2f}/{r['load_avg_after']:.2f}; GET "
        f"rate with a busy-loop process beside it: {r['get_rate_ratio_with_busy_loop']:.0%} of "
        "without" + ("  (NOISY: other work was running)" if r["noisy"] else ""),
        f"  {'':26} {'time_s median [min-max]':>23} {'MB/s':>8} {'cpu s':>6} {'server':>6}",
        f"  {'raw s3fs pipe_file (PUT)':26} {fmt(sp['raw_put']):>23} {r['raw_put_mb_s']:8.1f} "
        f"{cpus('raw_put')}",
        f"  {'raw boto3 upload_fileobj':26} {fmt(sp['boto3_put']):>23} {r['boto3_put_mb_s']:8.1f} "
        f"{cpus('boto3_put')}",
        f"  {'  with elastictrain settings':26} {fmt(sp['boto3_tuned_put']):>23} "
        f"{r['boto3_tuned_put_mb_s']:8.1f} {cpus('boto3_tuned_put')}",
        f"  {'elastictrain persist':26} {fmt(sp['persist']):>23} {r['persist_mb_s']:8.1f} "
        f"{cpus('persist')}   vs best raw {r['persist_vs_best_raw_put']:.2f} (s3fs "
        f"{fmt(r['persist_vs_raw_put_spread'], 2)}, boto3 {r['persist_vs_boto3_put']:.2f}, "
        f"tuned {r['persist_vs_boto3_tuned_put']:.2f})",
        f"  {'  serialize + checksum':26} {fmt(sp['serialize']):>23} {'':8} {cpus('serialize')}",
        f"  {'  commit: lookup + PUT':26} {fmt(sp['commit_requests']):>23} {'':8} "
        f"{cpus('commit_requests')}   floor (best raw put + these) {r['persist_floor_s']:.3f} s,"
        f" persist_vs_floor {r['persist_vs_floor']:.2f}",
        f"  {'raw s3fs cat_file (GET)':26} {fmt(sp['raw_get']):>23} {r['raw_get_mb_s']:8.1f} "
        f"{cpus('raw_get')}",
        f"  {'raw boto3 download_fileobj':26} {fmt(sp['boto3_get']):>23} "
        f"{r['boto3_get_mb_s']:8.1f} {cpus('boto3_get')}",
        f"  {'elastictrain restore':26} {fmt(sp['restore']):>23} {r['restore_mb_s']:8.1f} "
        f"{cpus('restore')}   vs best raw {r['restore_vs_best_raw_get']:.2f} (s3fs "
        f"{fmt(r['restore_vs_raw_get_spread'], 2)}, boto3 {r['restore_vs_boto3_get']:.2f})",
        f"  {'restore with torch.load':26} {fmt(sp['restore_with_load']):>23} {'':8} "
        f"{cpus('restore_with_load')}   restore_with_load_vs_raw_get "
        f"{r['restore_with_load_vs_raw_get']:.2f}",
        "  cpu s: CPU seconds of this process (all threads); server: of the moto server",
        f"  peak Python memory beyond the state: persist "
        f"{r['persist_peak_python_bytes'] / MB:.1f} MB, raw put "
        f"{r['raw_put_peak_python_bytes'] / MB:.1f} MB (plus the raw bytes themselves)",
    ]
    return "\n".join(lines)


def plot(path: str, points: list[dict[str, Any]]) -> None:
    sizes = [p["size_bytes"] / MB for p in points]
    names = {"raw_put": "s3fs put", "boto3_put": "boto3 put", "persist": "elastictrain persist",
             "raw_get": "s3fs get", "boto3_get": "boto3 get", "restore": "elastictrain restore"}
    series = {label: [{k: p["size_bytes"] / MB / p["spread_s"][key][j]
                       for k, j in (("median", "median"), ("min", "max"), ("max", "min"))}
                      for p in points] for key, label in names.items()}
    plot_curve(path, "elastictrain on S3 (moto server) vs raw clients", sizes, series, "MB/s")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    et_log.configure("warning")  # events of every persist would drown the table
    points = []
    with contextlib.ExitStack() as stack:
        endpoint, server_pid = ((args.endpoint, None) if args.endpoint
                                else stack.enter_context(moto_process()))
        for size in args.sizes:
            points.append(run(args, endpoint, size, server_pid))
    if args.json is not None:
        write_json(args.json, {"sizes_mb": args.sizes, "points": points})
    if args.json != "-":
        print("\n\n".join(table(p) for p in points))
    if args.plot:
        plot(args.plot, points)


if __name__ == "__main__":
    main()
