"""`python -m corral.runner --config JSON`: the runner process (see `runner/process/main.py`).

The C bindings are registered before the engine is imported, so the process
never pays for llama-cpp-python's high-level layer (`runner/llama/capi.py`).
"""

from __future__ import annotations

import sys

from corral.runner.llama import capi

capi.install()

from corral.runner.process.loading import Pending  # noqa: E402  (the bindings must be in place first)

pending = Pending(sys.argv[1:])  # the model loads while the rest is imported

from corral.runner.process.main import main  # noqa: E402

sys.exit(main(pending=pending))
