"""MANIFEST.json: the commit marker and table of contents of one snapshot."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elastictrain.core.config import ChecksumAlgorithm
from elastictrain.core.errors import SnapshotCorrupt

FORMAT_VERSION = 1
SHARDED_FORMAT_VERSION = 2  # objects written by several ranks (rank, items per object)


class ItemEntry(BaseModel):
    """One byte range of an object (a DCP write item), verified on its own at load."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    offset: int = Field(ge=0)
    length: int = Field(ge=0)
    checksum: str = Field(min_length=1)


class ObjectEntry(BaseModel):
    """One payload object: its name in the snapshot directory, size and checksum;
    in a sharded snapshot also the rank that wrote it and its items."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    size_bytes: int = Field(ge=0)
    checksum: str = Field(min_length=1)
    rank: int | None = Field(default=None, ge=0)
    items: list[ItemEntry] | None = None


class Manifest(BaseModel):
    """What a committed snapshot holds. Never contains credentials or storage options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = FORMAT_VERSION
    run_id: str
    step: int = Field(ge=0)
    epoch: int = Field(ge=0)
    world_size: int = Field(ge=1)
    created_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    torch_version: str
    elastictrain_version: str
    checksum_algorithm: ChecksumAlgorithm
    objects: list[ObjectEntry]
    dataset_len: int | None = None
    global_batch_size: int | None = None
    # The job's attempt that took it (snapshot/state/attempt.py): it orders memory snapshots
    # of one step taken by different attempts. Absent from older manifests.
    attempt: int | None = Field(default=None, ge=0)
    # The loop's loss at this step (the writer's rank; snapshot/state/sense_check.py).
    loss: float | None = None
    signature: str | None = None  # HMAC over canonical_json() when a key is set (signing.py)

    @property
    def total_bytes(self) -> int:
        return sum(o.size_bytes for o in self.objects)

    def canonical_json(self) -> bytes:
        """Every field but ``signature``, in one fixed byte form: what is signed."""
        fields = self.model_dump(exclude=self._absent({"signature"}))
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def identity(self) -> str:
        """What two copies of one snapshot share and two different snapshots never do:
        sha256 over every field but when it was written and its signature (two nodes
        write their copies of a replicated snapshot each at its own time)."""
        fields = self.model_dump(exclude=self._absent({"signature", "created_at"}))
        return hashlib.sha256(json.dumps(fields, sort_keys=True,
                                         separators=(",", ":")).encode()).hexdigest()

    def _absent(self, exclude: set[str]) -> set[str]:
        """``exclude`` and the optional fields this manifest leaves out: a manifest
        written before a field existed reads, hashes and verifies as it did."""
        return exclude | {name for name in ("attempt", "loss") if getattr(self, name) is None}

    def to_json(self) -> bytes:
        data = self.model_dump(exclude=self._absent(set()))
        for entry in data["objects"]:  # format 1 manifests stay as they were
            for key in ("rank", "items"):
                if entry[key] is None:
                    del entry[key]
        return json.dumps(data, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate; anything else is a corrupt snapshot."""
        try:
            manifest = cls.model_validate_json(data)
        except ValidationError as exc:
            raise SnapshotCorrupt(f"{where}: invalid manifest ({exc.error_count()} errors: "
                                  f"{exc.errors()[0]['msg']})") from None
        if manifest.format_version > SHARDED_FORMAT_VERSION:
            raise SnapshotCorrupt(
                f"{where}: manifest format {manifest.format_version} is newer than this "
                f"elastictrain understands ({SHARDED_FORMAT_VERSION}); fix: upgrade elastictrain"
            )
        return manifest


@dataclass(frozen=True)
class SnapshotMeta:
    """Everything the manifest records besides the objects."""

    run_id: str
    step: int
    epoch: int
    world_size: int
    checksum_algorithm: ChecksumAlgorithm
    dataset_len: int | None = None
    global_batch_size: int | None = None
    attempt: int | None = None  # the job's attempt that takes it (snapshot/state/attempt.py)
    loss: float | None = None  # the loop's loss at this step, if it gave one
    # A second save() of a step this process saved already (the user changed state at
    # that step, e.g. ``epoch += 1``): its copy replaces the committed one instead of
    # being dropped as existing. Not recorded in the manifest.
    replaces: bool = False
