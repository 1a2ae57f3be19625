"""Write this worker's environment to OUT.<RANK>.json (tests/test_forked_launch.py); imports nothing heavy."""

import json
import os
import sys

with open(f"{sys.argv[1]}.{os.environ['RANK']}.json", "w") as f:
    json.dump(dict(os.environ), f)
