"""`python -m corral.runner --config JSON`: the runner process (see `runner/process.py`).

The C bindings are registered before the engine is imported, so the process
never pays for llama-cpp-python's high-level layer (`runner/capi.py`).
"""

from __future__ import annotations

import sys

from corral.runner import capi

capi.install()

from corral.runner.loading import Pending  # noqa: E402  (the bindings must be in place first)

pending = Pending(sys.argv[1:])  # the model loads while the rest is imported

from corral.runner.process import main  # noqa: E402

sys.exit(main(pending=pending))
