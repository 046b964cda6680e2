"""Case 14: credentials inside a storage URL are refused before any request, with one
line that says where credentials go instead; no output and no file of any failing
command contains them."""
from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.core.errors import ConfigError
from elastictrain.storage import FsspecStore
from tests.s3server import FAKE_KEY, FAKE_SECRET, assert_no_secret


def _with_credentials(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{FAKE_KEY}:{FAKE_SECRET}@{rest}"


@pytest.mark.parametrize("url", ["s3://bucket/run", "memory://run", "gs://bucket/run"])
def test_store_refuses_credentials_in_url_without_echoing_them(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        FsspecStore(_with_credentials(url))
    message = str(info.value)
    assert_no_secret(message, where="the error")
    assert "\n" not in message and url in message and "storage_options" in message


@pytest.mark.parametrize(("url", "meant"), [
    ("s3//bucket/run", "s3://bucket/run"), ("s3:/bucket/run", "s3://bucket/run"),
    ("S3:bucket/run", "s3://bucket/run"), ("gs//bucket", "gs://bucket"),
    ("memory:/run", "memory://run")])
def test_a_misspelled_scheme_is_refused_with_the_url_meant(url: str, meant: str,
                                                           tmp_path: Path) -> None:
    """Taken as a local path, ``s3//bucket/run`` would train to ./s3/bucket/run."""
    with pytest.raises(ConfigError) as info:
        FsspecStore(url)
    message = str(info.value)
    assert "\n" not in message and f"e.g. {meant} " in message
    for local in ("./s3//bucket", str(tmp_path / "s3:" / "x"), "s3_run", "s3", "s3/run"):
        FsspecStore(local)  # local paths, however they look, stay local paths
    (tmp_path / "s3" / "bucket").mkdir(parents=True)
    FsspecStore(str(tmp_path / "s3//bucket"))  # a directory of that name that exists wins


