"""MLoT Spark engine: model, memory cascade, generation, sessions (no Qt).

Importing it sets one process-wide policy before PyTorch loads its OpenMP runtime: OpenMP workers sleep when idle
(OMP_WAIT_POLICY=PASSIVE) instead of spinning. The native kernels' thread pool runs every matrix product; PyTorch's
workers, left spinning after each of its own operations (attention, norms), took the cores the pool's workers and
the GUI thread need (a 2-thread prefill ran slower than a 1-thread one). A user's own setting wins.
"""

import os

__version__ = "0.1.0"

USER_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")  # as the user gave it (bench peers get it back)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
