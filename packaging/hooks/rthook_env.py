"""PyInstaller runtime hook: runs in the frozen app before any of its modules, so before torch is imported.

torch reads some of these when it initialises a device; engine/backends/torch_backend.py sets the fallback
too, but only once a backend is opened, which may be after something imported torch. setdefault: a value the
user exported (e.g. to debug) wins.
"""

import os

# Ops that MPS lacks run on the CPU instead of failing in the middle of a reply.
os.environ.setdefault("PYTORCH_ENABLE_MPS_FALLBACK", "1")
# The tokenizers crate's thread pool would warn (and can deadlock) if the process forks after using it.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
