"""Where a command line's storage location points: its ``--storage-options`` JSON, a
refusal of a location that cannot hold a run (with the fix), and the store opened with
every storage setting applied. Shared by every command that takes a storage; it imports
no torch, so that the operator commands start quickly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elastictrain.core.config import load_settings
from elastictrain.core.errors import ConfigError
from elastictrain.storage.api import Store
from elastictrain.storage.fsspec_store import open_store
from elastictrain.storage.urls import meant_url


def parse_storage_options(text: str | None, flag: str = "--storage-options") -> dict[str, Any]:
    """The JSON object given on the command line ({} when absent). The error never
    quotes the text: it may hold a secret."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} is not JSON ({exc.msg} at character {exc.pos}); fix: pass "
                          'a JSON object such as \'{"anon": true}\'') from None
    if not isinstance(options, dict):
        raise ConfigError(f"{flag} must be a JSON object, got a {type(options).__name__}; "
                          'fix: pass a JSON object such as \'{"anon": true}\'')
    return options


_RUN_ROOT_HINT = "the --storage of demo or run, which holds snapshots/ and events/"


def check_location(url: str, what: str = "storage root", hint: str = _RUN_ROOT_HINT) -> None:
    """Refuse a location given on the command line that cannot hold a run: a local path
    that does not exist or is not a directory, or a URL with a mistyped scheme. A URL is
    left to the store, which says whether its bucket exists.

    Raises:
        ConfigError: names the path, the problem and the fix.
    """
    if "://" in url:
        return
    path = Path(url)
    if path.is_dir():
        return  # a real directory wins, even one named like a URL
    typo = meant_url(url, lone_slash=True)  # never echoes user:secret@
    if typo is not None:
        shown, meant = typo
        raise ConfigError(f"{what} {shown!r} is neither a URL nor a directory; fix: write "
                          f"the URL with '://', e.g. {meant}")
    if path.exists():
        raise ConfigError(f"{what} {url}: not a directory; fix: pass a directory ({hint})")
    raise ConfigError(f"{what} {url}: no such directory; fix: check the path ({hint})")


def open_from_cli(url: str, storage_options_json: str | None) -> Store:
    """The store at ``url`` with every storage setting applied: ``ELASTICTRAIN_STORAGE__*``
    and the config file, then ``--storage-options`` (and fsspec's ``FSSPEC_S3_*``).

    Raises:
        ConfigError: bad options or settings, or a location that cannot be a run's.
    """
    storage: dict[str, Any] = {"url": url}
    options = parse_storage_options(storage_options_json)
    if options:
        storage["storage_options"] = options
    settings = load_settings(storage=storage).storage
    check_location(url)
    return open_store(settings)
