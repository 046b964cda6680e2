"""Fixtures: a real moto S3 server for the session, a fresh bucket for each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("moto.moto_server.werkzeug_app", reason="needs moto[server] (test extra)")
pytest.importorskip("s3fs", reason="needs s3fs (the s3 extra)")

from tests.s3server import MotoS3, S3Bucket, fresh_bucket, moto_session


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3]:
    """moto's S3 on 127.0.0.1 at a free port, stopped at the end of the session."""
    yield from moto_session()


@pytest.fixture
def s3(moto_server: MotoS3) -> Iterator[S3Bucket]:
    """A reset server with one empty bucket; fsspec's instance cache cleared around it."""
    yield from fresh_bucket(moto_server)
