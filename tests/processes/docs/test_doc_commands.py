"""Every command the docs show for reading a run (``status``, ``snapshots …``, ``goodput``,
``--help``, ``--version``) runs as written against a real run: one demo run with a kill,
in its default directory, and the same run copied to S3 (moto on 127.0.0.1) for the
``s3://`` forms. A page's placeholders become that run's (its id, its last step, the
local server's endpoint); nothing else in a command changes.

The commands that train (``demo``, ``run``, ``chaos``) are parsed by the docs' unit tests
and run for real by the end-to-end tests (the README's two commands by CI itself), as is
the one that serves until stopped (``rendezvous-store``)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_cli
from tests.s3server import FAKE_KEY, FAKE_SECRET, MotoS3
from tests.unit.docs.test_docs import command_lines

# One demo run for all (the module fixture): the tests stay on one xdist worker.
pytestmark = [pytest.mark.processes, pytest.mark.timeout(600),
              pytest.mark.xdist_group("doc-commands")]

READING = {"status", "snapshots", "goodput", "--help", "--version"}
TRAINING = {"demo", "run", "chaos"}  # run for real elsewhere (module docstring)
# Serves until stopped: run for real by tests/processes/multinode/test_rdzv_store_run.py.
SERVING = {"rendezvous-store"}
# Local directories the pages use for a run: here, all the one demo run.
RUN_DIRS = ("./elastictrain-demo", "./elastictrain-run", "./ckpt", "./run", "/tmp/run1",
            "/tmp/x")
# The buckets the pages name.
BUCKETS = {"my-bucket": "runs/exp1", "bucket": "run"}


def reading_commands() -> list[str]:
    found = []
    for _page, line in command_lines("elastictrain"):
        words = shlex.split(line)
        sub = words[1] if len(words) > 1 else ""
        if sub in READING or words[1:] == ["run", "--help"]:
            found.append(line)
        else:
            assert sub in TRAINING | SERVING, \
                f"a docs command of a kind this test does not know: {line}"
    return sorted(set(found))


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One demo run with a kill in ``./elastictrain-demo`` of a fresh directory."""
    cwd = tmp_path_factory.mktemp("docs-run")
    result = run_cli(["demo", "--steps", "60", "--kill-at", "30", "--json"], cwd, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    storage = cwd / "elastictrain-demo"
    [events] = [p for p in (storage / "events").iterdir() if p.is_dir()]
    steps = sorted(int(m) for m in re.findall(r'"step": (\d+)', run_cli(
        ["snapshots", "list", str(storage), "--json"], cwd).stdout))
    return {"cwd": cwd, "storage": storage, "run_id": events.name, "last_step": steps[-1],
            "summary": summary}


@pytest.fixture(scope="module")
def s3_copies(demo_run: dict[str, Any]) -> Any:
    """The demo run copied into the buckets the pages name, on a server of this module."""
    server = MotoS3()
    server.start()
    try:
        client = server.client()
        for bucket, prefix in BUCKETS.items():
            client.create_bucket(Bucket=bucket)
            for path in demo_run["storage"].rglob("*"):
                if path.is_file():
                    key = f"{prefix}/{path.relative_to(demo_run['storage'])}"
                    client.upload_file(str(path), bucket, key)
        yield server
    finally:
        server.stop()


def as_run_here(line: str, run: dict[str, Any], endpoint: str) -> list[str]:
    """The page's command with its placeholders filled for this run."""
    line = line.replace("RUN_ID", run["run_id"]).replace("http://127.0.0.1:9000", endpoint)
    line = re.sub(r"/events/demo-[0-9a-f-]+", f"/events/{run['run_id']}", line)
    words = shlex.split(line)[1:]
    for i, word in enumerate(words):
        for directory in RUN_DIRS:
            if word == directory or word.startswith(directory + "/"):
                words[i] = "./elastictrain-demo" + word[len(directory):]
        if i and words[i - 1] == "--step":
            words[i] = str(run["last_step"])  # the pages' step of a 300-step run
    return words


def test_the_docs_show_reading_commands_of_every_kind() -> None:
    kinds = {shlex.split(line)[1] for line in reading_commands()}
    assert kinds == READING | {"run"}


@pytest.mark.parametrize("line", reading_commands())
def test_a_reading_command_of_the_docs_runs_as_written(
        line: str, demo_run: dict[str, Any], s3_copies: MotoS3, tmp_path: Path) -> None:
    # A directory of its own (an export's output file is per command), the run linked in.
    cwd = tmp_path
    (cwd / "elastictrain-demo").symlink_to(demo_run["storage"])
    (cwd / "docs").mkdir()  # a page's `--plot docs/….png`, written here
    args = as_run_here(line, demo_run, s3_copies.endpoint)
    result = run_cli(args, cwd, timeout=120, AWS_ACCESS_KEY_ID=FAKE_KEY,
                     AWS_SECRET_ACCESS_KEY=FAKE_SECRET, AWS_EC2_METADATA_DISABLED="true",
                     AWS_ENDPOINT_URL=s3_copies.endpoint)
    shown = (f"`{shlex.join(['elastictrain', *args])}`:\n{result.stdout[-1500:]}\n"
             f"{result.stderr[-3000:]}")
    assert result.returncode == 0, shown
    assert "Traceback" not in result.stderr, shown
    assert FAKE_SECRET not in result.stdout + result.stderr
