"""Optional signed manifests: who wrote a snapshot, not only whether its bytes are intact.

crc32/sha256 in the manifest show integrity; anyone who can write to the storage
can recompute them. With ``ELASTICTRAIN_SIGNING_KEY`` set, the writer adds an
HMAC-SHA256 over the manifest's canonical JSON (payload names, sizes and
checksums included), and every read of a manifest checks it before any payload
byte is deserialized: an unsigned or wrongly signed snapshot is reported
(``snapshot.unsigned``) and skipped like a corrupt one. The key is only ever
passed to ``hmac``: it is never logged, stored or put in a message. See
docs/trust.md.
"""

from __future__ import annotations

import hashlib
import hmac

from elastictrain.core.env import signing_key
from elastictrain.core.errors import SnapshotUntrusted
from elastictrain.core.log import get_logger
from elastictrain.snapshot.format.manifest import Manifest

log = get_logger("elastictrain.snapshot")

_SCHEME = "hmac-sha256:"


def sign(manifest: Manifest) -> Manifest:
    """``manifest`` with its signature when a key is set; unchanged otherwise."""
    key = signing_key()
    if key is None:
        return manifest
    return manifest.model_copy(update={"signature": _signature(key, manifest)})


def check(manifest: Manifest, where: str) -> None:
    """With a key set, raise SnapshotUntrusted unless ``manifest`` carries our signature.

    Without a key nothing is checked: the checksums then show integrity only.
    """
    key = signing_key()
    if key is None:
        return
    if manifest.signature is None:
        reason = "the manifest is not signed"
    elif not hmac.compare_digest(manifest.signature, _signature(key, manifest)):
        reason = "the manifest's signature does not match ELASTICTRAIN_SIGNING_KEY"
    else:
        return
    log.error("snapshot.unsigned", snapshot_step=manifest.step, where=where, reason=reason,
              action="never deserialized; skipped like a corrupt snapshot")
    raise SnapshotUntrusted(
        f"{where}: {reason}, so it was not written by a holder of the signing key and is "
        "not loaded; fix: find out who wrote it, or unset ELASTICTRAIN_SIGNING_KEY to "
        "accept unsigned snapshots (checksums then show integrity only)"
    )


def _signature(key: bytes, manifest: Manifest) -> str:
    return _SCHEME + hmac.new(key, manifest.canonical_json(), hashlib.sha256).hexdigest()
