"""A job whose workers print a line, then fail on an import that cannot succeed: before
``et.init()`` (``before``) or after it (``after``). Run by ``elastictrain run`` for
tests/processes/launcher/test_early_failure_run.py and
tests/processes/view/test_early_failure_tmux.py, not by pytest.

    elastictrain run ... tests/processes/launcher/early_failure_job.py STORAGE before|after
"""

from __future__ import annotations

import os
import sys

print(f"hello from rank {os.environ.get('RANK')}", flush=True)
if sys.argv[2] == "after":
    import elastictrain as et

    et.init(et.load_settings(storage={"url": sys.argv[1]}))
import no_such_module_for_the_test  # noqa: E402, F401  # the failure the tests look for
