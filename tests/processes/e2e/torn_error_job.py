"""A worker that leaves a torn torchrun error file (as one killed while writing it
would) and fails on its first attempt; the next attempt succeeds."""

import os
import sys

if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as torn:
            torn.write('{"message": {"message": "cut sh')
        sys.exit(1)
