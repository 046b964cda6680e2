"""Storage URLs in messages: credentials never appear in one, and are refused in a URL."""

from __future__ import annotations

import re

from elastictrain.core.errors import ConfigError

_CREDENTIALS_IN_URL = re.compile(r"(?<=://)[^/@]+@")


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
