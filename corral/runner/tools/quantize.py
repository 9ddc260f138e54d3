"""Quantizing a GGUF with llama.cpp's `llama_model_quantize`, in a child process.

A crash in native code (a malformed tensor, an allocation failure) ends the child,
never the daemon. The child writes to the path it is given; the caller owns that
path and deletes it on any failure. llama.cpp logs one line per tensor,
`[  12/ 272] blk.0.attn_k.weight ...`, on stderr; the parent turns those into
progress events.

    python -m corral.runner.tools.quantize SRC DST TYPE [--requantize]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

from corral.process import package_parent
from corral.errors import Cancelled, CorralError
from corral.registry.derive import file_type

_TENSOR_LINE = re.compile(rb"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")


def quantize_in_child(src: Path, dst: Path, type_name: str, requantize: bool,
                      progress: Callable[[int, int, str], None],
                      cancelled: Callable[[], bool] = lambda: False) -> None:
    """Run the child to completion; raise CorralError with its last words if it fails."""
    file_type(type_name)
    cmd = [sys.executable, "-m", "corral.runner.tools.quantize", str(src), str(dst), type_name]
    if requantize:
        cmd.append("--requantize")
    root = package_parent()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd=root, start_new_session=True)
    tail: list[bytes] = []
    assert proc.stderr is not None
    try:
        for line in proc.stderr:
            if cancelled():
                raise Cancelled("create cancelled")
            match = _TENSOR_LINE.search(line)
            if match:
                progress(int(match.group(1)), int(match.group(2)),
                         match.group(3).decode("utf-8", "replace"))
            elif line.strip():
                tail = (tail + [line.strip()])[-4:]
        code = proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if code != 0:
        words = b" | ".join(tail).decode("utf-8", "replace")[-300:]
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        raise CorralError(f"quantizing failed ({how}): {words}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("type")
    parser.add_argument("--requantize", action="store_true")
    args = parser.parse_args()
    from corral.runner.llama import capi

    llama = capi.install()
    llama.llama_backend_init()
    params = llama.llama_model_quantize_default_params()
    params.ftype = file_type(args.type)
    params.allow_requantize = args.requantize
    params.nthread = os.cpu_count() or 1
    rc = llama.llama_model_quantize(args.src.encode(), args.dst.encode(), params)
    if rc != 0:
        print(f"llama_model_quantize returned {rc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except CorralError as exc:
        print(exc.message, file=sys.stderr)
        sys.exit(2)
