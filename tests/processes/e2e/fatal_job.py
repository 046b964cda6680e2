"""A job whose workers raise an elastictrain error after ``et.init()`` (run by torchrun
for tests/processes/e2e/test_exit_codes.py, not by pytest).

    python -m torch.distributed.run ... tests/processes/e2e/fatal_job.py STORAGE ERROR_CLASS
"""

from __future__ import annotations

import sys

import elastictrain as et
from elastictrain.core import errors


def main() -> None:
    storage, error_name = sys.argv[1:3]
    et.init(et.load_settings(storage={"url": storage}))
    try:
        error = getattr(errors, error_name)
        raise error(f"planted {error_name}; fix: nothing, the test wants it")
    finally:
        et.shutdown()


if __name__ == "__main__":
    main()
