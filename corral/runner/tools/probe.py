"""A projector's trial load, in a child process: whether a `FROM` projector loads with an
encoder this engine can feed (runner.llama.vision), asked at create time.

llama.cpp may abort on a malformed file, so the daemon runs the load in a child
(`probe_in_child`): a crash there is an answer, not a dead daemon. An audio encoder is
also run once, on a second of silence, beside the text model's vocabulary (mtmd
tokenizes the clip's begin and end markers with it): the pinned mtmd loads and
tokenizes some audio projectors (ultravox, voxtral) that abort the process at their
first encode, because it counts one token fewer than their encoder gives. Warmup does
not find that; only an encode does, and a create is the place to learn it, not a
user's first question.

    python -m corral.runner.tools.probe PROJECTOR.gguf [MODEL.gguf]
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

from corral.process import package_parent, quiet_native_aborts

_log_hook: Any = None  # the log callback, kept alive while llama.cpp may call it

PROBE_TIMEOUT = 120.0
_GGML_LOG_ERROR = 4
_AUDIO = 2  # MTMD_INPUT_CHUNK_TYPE_AUDIO
_ENCODING = "probe: encoding a clip"  # said on stderr first: a crash after it is the encoder's


def probe(path: str, model_path: str | None = None) -> str | None:
    """Load the projector as the runner would, beside the text model's vocabulary when it
    is given: None when it loads with an encoder this engine can feed (and an audio
    encoder encodes), else why not. The caller runs this in a child (`probe_in_child`)."""
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
    model = None
    if model_path:
        params = L.llama_model_default_params()
        params.n_gpu_layers, params.vocab_only = 0, True  # the vocabulary, not the weights
        model = L.llama_model_load_from_file(model_path.encode(), params)
    params = M.mtmd_context_params_default()
    params.use_gpu, params.warmup, params.print_timings = False, False, False
    ctx = M.mtmd_init_from_file(path.encode(), model, params)
    try:
        if not ctx:  # the first error is the cause; no server path goes back to a client
            return errors[0].replace(path, "<projector>") if errors else \
                "llama.cpp could not load the projector"
        if not (M.mtmd_support_vision(ctx) or M.mtmd_support_audio(ctx)):
            return "the projector has no vision or audio encoder"
        if M.mtmd_support_audio(ctx) and model:
            return _trial_encode(M, ctx)
        return None
    finally:
        if ctx:
            M.mtmd_free(ctx)
        if model:
            L.llama_model_free(model)


def _trial_encode(M: Any, ctx: Any) -> str | None:
    """Encode one second of silence: an encoder that mtmd miscounts aborts here."""
    rate = max(int(M.mtmd_get_audio_sample_rate(ctx)), 1)
    bitmap = M.mtmd_bitmap_init_from_audio(rate, (ctypes.c_float * rate)())
    text = M.mtmd_input_text()
    marker = M.mtmd_default_marker()
    text.text, text.text_len, text.add_special, text.parse_special = \
        marker, len(marker), False, True
    chunks = M.mtmd_input_chunks_init()
    try:
        if M.mtmd_tokenize(ctx, chunks, ctypes.byref(text),
                           (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
            return "llama.cpp could not tokenize a clip for the projector"
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(chunk) != _AUDIO:
                continue
            print(_ENCODING, file=sys.stderr, flush=True)
            if M.mtmd_encode_chunk(ctx, chunk) != 0:
                return "the projector could not encode a clip"
        return None
    finally:
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_bitmap_free(bitmap)


def probe_in_child(path: str, model_path: str | None = None) -> str | None:
    """`probe` in a fresh process: a crash there is an answer, not a dead daemon."""
    import subprocess

    root = package_parent()
    try:
        proc = subprocess.run([sys.executable, "-m", "corral.runner.tools.probe", path,
                               *([model_path] if model_path else [])], cwd=root,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return "loading the projector timed out"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if lines:
        return lines[-1]
    return _crash(proc.returncode, proc.stderr)


def _crash(code: int, stderr: str) -> str:
    """Why the child died, with llama.cpp's last words: in the audio encoder's trial
    encode, or in the load."""
    said = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    last = next((ln.split(": ", 1)[-1] for ln in reversed(said)
                 if "GGML_ASSERT" in ln or ".cpp:" in ln), "")
    why = f" ({last})" if last else ""
    if _ENCODING in said:
        return (f"the projector's audio encoder aborted llama.cpp on a trial encode{why}:"
                " the pinned llama.cpp cannot serve this projector")
    return f"loading the projector crashed (exit {code}){why}"


if __name__ == "__main__":
    quiet_native_aborts()  # an abort's answer is its message, not a debugger's backtrace
    problem = probe(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    if problem:
        print(problem, flush=True)
    sys.exit(1 if problem else 0)
