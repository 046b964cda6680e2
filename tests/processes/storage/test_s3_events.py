"""Runs on object storage keep their events: the real demo (torchrun, a real SIGKILL)
with its snapshots on moto's S3 server leaves every process's event file in the bucket,
and ``elastictrain goodput s3://…`` reads the run from there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastictrain.runlog.events_read import parse_event_lines
from tests.helpers import run_cli
from tests.s3server import S3Bucket, assert_no_secret

pytestmark = [pytest.mark.distributed, pytest.mark.s3]


def test_demo_on_s3_uploads_its_events_and_goodput_reads_them(
        s3: S3Bucket, tmp_path: Path) -> None:
    options = json.dumps(s3.options)
    done = run_cli(["demo", "--json", f"--storage={s3.url()}", "--steps=40",
                    "--snapshot-every=10", "--kill-at=25"], tmp_path, timeout=300,
                   AWS_EC2_METADATA_DISABLED="true", ELASTICTRAIN_STORAGE__STORAGE_OPTIONS=options)
    assert done.returncode == 0, done.stderr[-4000:]
    run_id = Path(json.loads(done.stdout)["events_dir"]).name

    keys = s3.keys(f"run/events/{run_id}/")
    names = [key.rsplit("/", 1)[1] for key in keys]
    # Two attempts (the kill and the restart) x two ranks, and the agent's own file.
    assert len([n for n in names if n.startswith("attempt") and n.endswith("-rank0.jsonl")]) == 2
    assert len([n for n in names if n.startswith("attempt") and n.endswith("-rank1.jsonl")]) == 2
    assert any(n.startswith("agent-") for n in names)
    client = s3.server.client()
    bodies = {key: client.get_object(Bucket=s3.name, Key=key)["Body"].read() for key in keys}
    assert_no_secret(*bodies.values(), where="uploaded event files")
    uploaded = [e for body in bodies.values() for e in parse_event_lines(body.decode())]
    # The killed attempt's last events came up too (uploaded by the agent after the kill).
    assert any(e["event"] == "demo.kill" for e in uploaded)
    assert any(e["event"] == "run.finished" for e in uploaded)

    report = run_cli(["goodput", f"{s3.url()}/events/{run_id}", "--json",
                      f"--storage-options={options}"], tmp_path,
                     AWS_EC2_METADATA_DISABLED="true")
    assert report.returncode == 0, report.stderr[-2000:]
    got = json.loads(report.stdout)
    assert got["attempts"] == 2 and got["final_step"] == 40 and got["productive_s"] > 0
