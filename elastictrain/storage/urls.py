"""Storage URLs: credentials never appear in a message and are refused in a URL; a
misspelled scheme (``s3//bucket``) is refused rather than taken as a local path."""

from __future__ import annotations

import re

from elastictrain.core.errors import ConfigError

_CREDENTIALS_IN_URL = re.compile(r"(?<=://)[^/@]+@")
# A storage scheme followed by a misspelled separator (``s3//b``, ``s3:/b``, ``s3:b``):
# as a local path it would create ./s3/b and train there while the user expects S3.
_SCHEME_TYPO = re.compile(
    r"^(s3a?|gs|gcs|az|abfss?|adl|hdfs|file|memory|https?|s?ftp)(//|:/(?!/)|:(?!/))(.*)$",
    re.IGNORECASE)


def redact_url(url: str) -> str:
    """Drop ``user:secret@`` from a URL so it can be logged."""
    return _CREDENTIALS_IN_URL.sub("", url)


def refuse_credentials_in_url(url: str) -> None:
    """Raise ConfigError for ``scheme://user:secret@…``: fsspec backends do not take
    credentials from a URL (s3fs would send them as part of the bucket name, and the
    backend's errors would echo them), so they are refused before any request."""
    if _CREDENTIALS_IN_URL.search(url):
        raise ConfigError(
            f"storage URL {redact_url(url)!r} has credentials in it (user:secret@, removed "
            "here); fix: remove them from the URL and pass them as storage_options "
            "key/secret (--storage-options or ELASTICTRAIN_STORAGE__STORAGE_OPTIONS) or "
            "through the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE)"
        )


def refuse_misspelled_scheme(url: str) -> None:
    """Raise ConfigError for a storage scheme with a misspelled ``://`` (``s3//bucket``,
    ``s3:/bucket``, ``s3:bucket``), before anything is written: taken as a local path it
    would put the run on local disk under ``./s3``."""
    typo = _SCHEME_TYPO.match(url)
    if typo is None:
        return
    scheme, rest = typo.group(1).lower(), typo.group(3).lstrip("/")
    raise ConfigError(
        f"storage URL {redact_url(url)!r} looks like a misspelled {scheme}:// URL; fix: "
        f"write {scheme}://{rest} (for a local directory of that name, write ./{url})")
