"""scripts/bench_shard_sum.py's pure parts: the bytes each rank sends per step."""

from __future__ import annotations

import sys

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import bench_shard_sum


def test_bytes_sent_per_rank_follow_the_collectives() -> None:
    # 2 ranks of 2 shards each: 2 segments (to the other rank) + 1 (the gather) against
    # a ring all-reduce's 2, each segment half the 1000 elements of 4 bytes.
    assert bench_shard_sum.sent_bytes(1000, 2, 4) == {"ddp": 2 * 500 * 4,
                                                      "shards": (2 + 1) * 500 * 4}
    # 8 ranks, 24 shards: 3 held; 7 peers get a segment of each, then the gather.
    sent = bench_shard_sum.sent_bytes(8000, 8, 24)
    assert sent == {"ddp": 2 * 7 * 1000 * 4, "shards": (3 * 7 + 7) * 1000 * 4}
