"""Pointing elastictrain at S3: settings, environment, fsspec's FSSPEC_S3_* config and
the credential chain all reach the store, from the library and from the CLI; no
route ever prints a credential."""
from __future__ import annotations

import json

import pytest

from elastictrain.core.config import StorageConfig, load_settings
from elastictrain.core.errors import ConfigError, StorageError
from elastictrain.storage import FsspecStore, open_store
from tests.s3server import FAKE_KEY, FAKE_SECRET, S3Bucket, assert_no_secret

MIB = 2**20
def test_storage_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    options = {"key": FAKE_KEY, "secret": FAKE_SECRET,
               "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}
    monkeypatch.setenv("ELASTICTRAIN_STORAGE__STORAGE_OPTIONS", json.dumps(options))
    monkeypatch.setenv("ELASTICTRAIN_STORAGE__PART_SIZE_BYTES", str(8 * MIB))
    monkeypatch.setenv("ELASTICTRAIN_STORAGE__UPLOAD_CONCURRENCY", "2")
    settings = load_settings(storage={"url": "s3://bucket/run"})
    assert settings.storage.url == "s3://bucket/run"
    assert settings.storage.storage_options == options
    assert (settings.storage.part_size_bytes, settings.storage.upload_concurrency) == (8 * MIB, 2)
    assert_no_secret(repr(settings), str(settings), where="Settings repr")


def test_part_size_below_the_s3_minimum_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"storage.part_size_bytes=1000: .*5242880"):
        load_settings(storage={"part_size_bytes": 1000})


def test_bad_storage_options_never_echo_their_values() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(storage={"storage_options": f"secret={FAKE_SECRET}"})
    assert_no_secret(str(info.value), where="config error")
    with pytest.raises(StorageError) as opened:
        FsspecStore("s3://bucket/run", {"no_such_option": FAKE_SECRET}).list_dir("")
    assert_no_secret(str(opened.value), where="open error")


@pytest.mark.s3
def test_store_from_config_applies_every_setting(s3: S3Bucket) -> None:
    config = StorageConfig(url=s3.url(), storage_options=s3.options, retries=1,
                           part_size_bytes=5 * MIB, multipart_threshold_bytes=5 * MIB,
                           upload_concurrency=1)
    store = open_store(config)
    with store.open_write("big.bin") as f:
        f.write(b"\1" * (11 * MIB))
    assert [r.part for r in s3.server.faults.seen(lambda r: r.op == "UploadPart")] == [1, 2, 3]


