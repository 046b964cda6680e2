"""Storage URLs: credentials never appear in a message and are refused in a URL; a
mistyped scheme (``s3//bucket``) is refused rather than taken as a new local path."""

from __future__ import annotations

import re
from pathlib import Path

from elastictrain.core.errors import ConfigError

_CREDENTIALS_IN_URL = re.compile(r"(?<=://)[^/@]+@")
# URL schemes a run's storage may use: a local path starting with one of them and a
# slash or colon but no "://" is almost surely a mistyped URL (s3//bucket, s3:/bucket).
_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory", "file")
_MISTYPED_URL = re.compile(rf"^({'|'.join(_SCHEMES)})(:/?|/+)(?=[^/])", re.IGNORECASE)
_USER_INFO = re.compile(r"^[^/@]+@")


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


def meant_url(url: str, *, lone_slash: bool = False) -> tuple[str, str] | None:
    """For a path that looks like a mistyped storage URL (``s3//bucket``, ``s3:/bucket``,
    ``s3:bucket``; with ``lone_slash`` also ``s3/bucket``): the path as a message may
    show it and the URL it meant, both without ``user:secret@``. None for anything else."""
    typo = None if "://" in url else _MISTYPED_URL.match(url)
    if typo is None or (typo.group(2) == "/" and not lone_slash):
        return None
    rest = _USER_INFO.sub("", url[typo.end():])
    return url[:typo.end()] + rest, f"{typo.group(1).lower()}://{rest}"


def refuse_misspelled_scheme(url: str) -> None:
    """Raise ConfigError for a storage location that looks like a mistyped URL
    (``meant_url``), before anything is written: taken as a local path it would put the
    run on local disk under ``./s3``. A directory of that name that exists wins."""
    typo = meant_url(url)
    if typo is None or Path(url).is_dir():
        return
    shown, meant = typo
    raise ConfigError(
        f"storage location {shown!r} is neither a URL nor a directory; fix: write the URL "
        f"with '://', e.g. {meant} (for a new local directory of that name: ./{shown})")
