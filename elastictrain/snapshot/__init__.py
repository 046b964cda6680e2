"""Snapshots: layout, manifest, staging, persisting, discovery and the manager."""
