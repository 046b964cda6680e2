"""The package's version (the one in pyproject.toml), importable by every module."""

__version__ = "0.1.0"
