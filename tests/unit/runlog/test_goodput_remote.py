"""``elastictrain goodput`` of a run on object storage reads the same files as the run's
local copy, so it gives the same figures and the same split, and draws its plot; a plot
named by a URL is written there (``memory://`` stands for S3: the same code path)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastictrain.cli import main
from elastictrain.storage import open_store
from tests.unit.runlog.test_goodput_split import write_synthetic_run

pytestmark = pytest.mark.usefixtures("logging_reset")
pytest.importorskip("matplotlib", reason="needs matplotlib (the plot extra)")


@pytest.fixture
def remote_run(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    local = write_synthetic_run(tmp_path)
    url = f"memory://goodput-{uuid.uuid4().hex[:8]}/run/events/r1"
    store = open_store(url)
    for path in local.glob("*.jsonl"):
        store.write_bytes(path.name, path.read_bytes())
    yield local, url
    store.delete("", recursive=True)


def _goodput(*args: str) -> None:
    with pytest.raises(SystemExit) as done:
        main(["goodput", *args])
    assert done.value.code == 0


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    _goodput(*args, "--json")
    return dict(json.loads(capsys.readouterr().out))


def test_the_remote_run_and_its_local_copy_agree(remote_run: tuple[Path, str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    local, url = remote_run
    here, there = _json(capsys, str(local)), _json(capsys, url)
    assert there["events_dir"] == url
    assert {k: v for k, v in here.items() if k != "events_dir"} == \
        {k: v for k, v in there.items() if k != "events_dir"}
    assert there["split"] is not None


def test_the_plot_of_a_remote_run_goes_where_it_is_asked(
        remote_run: tuple[Path, str], tmp_path: Path) -> None:
    _, url = remote_run
    _goodput(url, "--plot", str(tmp_path / "local.png"))
    assert (tmp_path / "local.png").read_bytes().startswith(b"\x89PNG")
    target = url.rsplit("/", 1)[0] + "/plots/goodput.png"
    _goodput(url, "--plot", target)
    parent, name = target.rsplit("/", 1)
    assert open_store(parent).read_bytes(name).startswith(b"\x89PNG")
