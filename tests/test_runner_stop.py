"""How the daemon stops a runner process, without llama.cpp: a stand-in runner that
cannot answer /shutdown (as a real one cannot while a context being made holds its GIL)
is asked with SIGTERM, so that it leaves on its own and writes its prompt cache's disk
tier, instead of being killed when the wait runs out."""

from __future__ import annotations

import sys
from pathlib import Path

from corral.runner.client import RunnerProcess
from corral.runner.loadconfig import LoadConfig
from tests.support import free_port

# Ready line with a port nothing listens on; SIGTERM ends it cleanly (exit status 0).
STAND_IN = '''#!{python}
import json, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print(json.dumps({{"port": {port}, "pid": 0, "report": {{}}}}), flush=True)
while True:
    time.sleep(0.1)
'''


def test_a_runner_that_cannot_answer_shutdown_gets_sigterm_not_sigkill(tmp_path: Path) -> None:
    script = tmp_path / "runner"
    script.write_text(STAND_IN.format(python=sys.executable, port=free_port()))
    script.chmod(0o755)
    runner = RunnerProcess(LoadConfig(model="unused", cache_disk=1 << 20,
                                      cache_dir=str(tmp_path)), python=str(script))
    runner.start(timeout=60)
    assert runner.proc is not None
    runner.stop(timeout=30)
    assert runner.proc.returncode == 0  # it left on SIGTERM; a kill would read -9
