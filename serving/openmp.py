"""libgomp settings for the services; import this module before torch (libgomp reads them when torch loads it).

After each parallel region an idle OpenMP worker spins for GOMP_SPINCOUNT iterations (default 300 000, several
milliseconds here) before it sleeps. The target and the draft service usually share one machine's cores and hand
work to each other every few milliseconds, so each service's spinning workers took a core from the other one:
measured on 2 cores (docs/PERFORMANCE.md), 10 000 spins cut the drafter's step from 6.8 to 6.2 ms and a one-row
verify from 39.7 to 38.3 ms, and AR was no slower. A value already in the environment wins.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "10000"

os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
BEFORE_TORCH = "torch" not in sys.modules  # False: the setting has no effect in this process
