"""The package imports its public names on first use: the CLI's operator commands start
without torch, and every public name still resolves."""
from __future__ import annotations

import pytest

import elastictrain


def test_every_public_name_resolves_to_its_module() -> None:
    for name in elastictrain.__all__:
        value = getattr(elastictrain, name)
        if name != "__version__":
            assert value.__module__.startswith("elastictrain."), name
    with pytest.raises(AttributeError, match="no_such_name"):
        elastictrain.no_such_name  # noqa: B018


