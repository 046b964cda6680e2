"""A process with its events on object storage ends as fast as one on local disk: its
last upload runs once, at exit, before the S3 client's own cleanup (else every try
fails on a closed session and retries for many seconds), and the bucket holds its
last event."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastictrain.runlog.events_read import parse_event_lines
from tests.helpers import REPO, child_env
from tests.s3server import S3Bucket

pytestmark = [pytest.mark.processes, pytest.mark.s3]

SCRIPT = """
import sys, time
import elastictrain as et
et.init()
import structlog
structlog.get_logger("elastictrain").info("script.last_event")
print(time.time(), flush=True)  # the script's end; the interpreter's exit follows
"""


def test_the_last_upload_at_exit_is_one_request_and_quick(s3: S3Bucket,
                                                           tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = child_env(tmp_path, PYTHONPATH=str(REPO), AWS_EC2_METADATA_DISABLED="true",
                    ELASTICTRAIN_STORAGE__URL=s3.url(),
                    ELASTICTRAIN_STORAGE__STORAGE_OPTIONS=json.dumps(s3.options))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    ended = time.time()
    assert done.returncode == 0, done.stderr[-3000:]
    exit_s = ended - float(done.stdout.split()[-1])
    keys = [k for k in s3.keys("run/events/") if k.endswith(".jsonl")]
    assert len(keys) == 1, (keys, exit_s, done.stderr[-2000:])
    body = s3.server.client().get_object(Bucket=s3.name, Key=keys[0])["Body"].read()
    assert any(e["event"] == "script.last_event" for e in parse_event_lines(body.decode()))
    assert exit_s < 2.0, f"the process took {exit_s:.1f} s to exit after its last line"
