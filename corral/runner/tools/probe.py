"""A projector's trial load, in a child process: whether a `FROM` projector loads with a
vision encoder this engine can feed (runner.llama.vision), asked at create time.

llama.cpp may abort on a malformed file, so the daemon runs the load in a child
(`probe_in_child`): a crash there is an answer, not a dead daemon.

    python -m corral.runner.tools.probe PROJECTOR.gguf
"""

from __future__ import annotations

import ctypes
from typing import Any

from corral.process import package_parent

_log_hook: Any = None  # the log callback, kept alive while llama.cpp may call it

PROBE_TIMEOUT = 120.0
_GGML_LOG_ERROR = 4


def probe(path: str) -> str | None:
    """Load the projector as the runner would, without a text model: None when it loads
    with a vision encoder this engine can feed, else why not. llama.cpp may abort on a
    malformed file, so the daemon runs this in a child (`probe_in_child`)."""
    from llama_cpp import llama_cpp as L
    from llama_cpp import mtmd_cpp as M

    errors: list[str] = []

    def hook(level: int, text: bytes, _user: Any) -> None:
        if level == _GGML_LOG_ERROR and text:
            errors.append(text.decode("utf-8", "replace").strip())

    global _log_hook
    _log_hook = L.llama_log_callback(hook)
    M.mtmd_helper_log_set(_log_hook, ctypes.c_void_p(0))
    L.llama_log_set(_log_hook, ctypes.c_void_p(0))
    L.llama_backend_init()
    params = M.mtmd_context_params_default()
    params.use_gpu, params.warmup, params.print_timings = False, False, False
    ctx = M.mtmd_init_from_file(path.encode(), None, params)
    if not ctx:  # the first error is the cause; no server path goes back to a client
        return errors[0].replace(path, "<projector>") if errors else \
            "llama.cpp could not load the projector"
    try:
        if not M.mtmd_support_vision(ctx):
            return "the projector has no vision encoder"
        if M.mtmd_decode_use_mrope(ctx):
            return "projectors with M-RoPE positions (Qwen2-VL and later) are not supported yet"
        return None
    finally:
        M.mtmd_free(ctx)


def probe_in_child(path: str) -> str | None:
    """`probe` in a fresh process: a crash there is an answer, not a dead daemon."""
    import subprocess
    import sys

    root = package_parent()
    try:
        proc = subprocess.run([sys.executable, "-m", "corral.runner.tools.probe", path], cwd=root,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return "loading the projector timed out"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return lines[-1] if lines else f"loading the projector crashed (exit {proc.returncode})"


if __name__ == "__main__":
    import sys

    problem = probe(sys.argv[1])
    if problem:
        print(problem, flush=True)
    sys.exit(1 if problem else 0)
