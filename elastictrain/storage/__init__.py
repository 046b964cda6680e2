"""Storage behind one protocol; the only package that imports fsspec."""

from elastictrain.storage.api import Store
from elastictrain.storage.fsspec_store import FsspecStore, open_store
from elastictrain.storage.urls import redact_url

__all__ = ["FsspecStore", "Store", "open_store", "redact_url"]
