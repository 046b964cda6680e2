"""deploy/slurm/train.sbatch holds the wiring the end-to-end test on a real Slurm relies
on (tests/processes/deploy/test_slurm_run.py)."""
from __future__ import annotations

import re

from tests.helpers import REPO

SBATCH = REPO / "deploy" / "slurm" / "train.sbatch"
SCRIPT = REPO / "scripts" / "slurm_local.sh"


def test_recipe_pins_the_wiring_the_tests_rely_on() -> None:
    text = SBATCH.read_text()
    assert "#SBATCH --signal=B:USR1@" in text and "trap 'kill -USR1" in text
    assert "#SBATCH --cpus-per-task=" in text and '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in text
    assert "$SLURM_JOB_ID" in text.split("ELASTICTRAIN_STORAGE__URL:-", 1)[1].splitlines()[0]
    grace = int(re.search(r"--shutdown-timeout=(\d+)", text).group(1))  # type: ignore[union-attr]
    assert grace < 30  # Slurm's default KillWait
    # 75 and 76 are requeued: by slurm.conf's RequeueExit, else by the script itself.
    assert "RequeueExit=75,76" in SCRIPT.read_text()
    assert re.search(r'case "\$rc" in\s+75\|76\)', text)


