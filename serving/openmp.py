"""libgomp settings for the services; import this module before torch (libgomp reads them when torch loads it).

After each parallel region an idle OpenMP worker spins for GOMP_SPINCOUNT iterations (default 300 000, several
milliseconds here) before it sleeps. The target and the draft service usually share one machine's cores and hand
work to each other every few milliseconds, so each service's spinning workers took a core from the other one:
measured on 2 cores (docs/PERFORMANCE.md), 10 000 spins cut the drafter's step from 6.8 to 6.2 ms and a one-row
verify from 39.7 to 38.3 ms, and AR was no slower.

libgomp also throttles: while it manages more threads than the machine has CPUs (a service's forward worker and one
other thread that ran a parallel region each keep a team), a worker spins 100 iterations, whatever GOMP_SPINCOUNT
says, unless OMP_WAIT_POLICY is ACTIVE (then 1 000). At 100 the target's second thread fell asleep between the compiled
step's parallel regions of a multi-row verify and every region waited for it to wake (docs/PERFORMANCE.md, "A served
multi-row verify waited for its second thread"). ACTIVE with the spin count above keeps 10 000 spins unthrottled and
1 000 throttled. Values already in the environment win.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "10000"
WAIT_POLICY = "ACTIVE"

os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
BEFORE_TORCH = "torch" not in sys.modules  # False: the settings have no effect in this process
