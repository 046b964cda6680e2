"""Sharded snapshots (FSDP2 / DTensor state): every rank writes its part, one commit."""
