"""llama.cpp's RPC backend: workers that hold layers for a model another host drives.

The vendored ggml exports the server entry point (`ggml_backend_rpc_start_server`,
protocol 3.x with n_threads and a device list) and `ggml_backend_rpc_add_server`,
which returns a backend registry of the worker's devices; registered, they join the
device list `llama_model_load_from_file` offloads to, as GPU-type devices. ctypes
bindings for both live here, since llama-cpp-python binds neither.

The protocol has no authentication: a worker must only listen on a trusted network.

    python -m corral.runner.tools.rpc [--host 127.0.0.1] [--port 50052] [--threads N] [--cache DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import os
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any

from corral.process import quiet_native_aborts
from corral.errors import RunnerError

DEFAULT_PORT = 50052
PROBE_SECONDS = 3.0
_CPU, _GPU, _IGPU = 0, 1, 2


@dataclass(frozen=True)
class Worker:
    endpoint: str
    free: int  # bytes its devices report free
    total: int


def _libs() -> tuple[Any, Any]:
    """(ggml, ggml-rpc) symbols, looked up through libllama's own handle.

    The wheel ships `libggml.so`, `.so.0` and `.so.0.x` as three copies, not links:
    opening one by another name would load a second ggml, with its own device
    registry that the model loader never sees."""
    from corral.runner.llama import capi

    llama = capi.install()
    ggml = rpc = llama.llama_cpp._lib
    if not hasattr(rpc, "ggml_backend_rpc_add_server"):
        raise RunnerError("this llama.cpp build has no RPC backend (build with GGML_RPC=ON; "
                          "install.sh does)")
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_name.restype = ctypes.c_char_p
    ggml.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                             ctypes.POINTER(ctypes.c_size_t)]
    ggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_name.restype = ctypes.c_char_p
    ggml.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_start_server.restype = None
    rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                                  ctypes.c_size_t, ctypes.c_size_t,
                                                  ctypes.POINTER(ctypes.c_void_p)]
    llama.llama_backend_init()
    return ggml, rpc


RPC_CMD_HELLO = 14  # fixed across protocol versions (ggml-rpc.cpp asserts it)
RPC_CONN_CAPS_SIZE = 24
RPC_PROTO_MAJOR = 7  # ggml-rpc.h in the pinned llama-cpp-python
HELLO_REPLY = struct.Struct("<BBBB24s")  # major, minor, patch, padding, conn_caps


def probe(endpoint: str, timeout: float = PROBE_SECONDS) -> tuple[int, int, int]:
    """The worker's protocol version, from a HELLO of our own; a RunnerError naming the
    worker unless it answers as a compatible RPC server.

    ggml's client aborts the whole process when a server cannot be reached, or answers
    with anything malformed or of another version, so the runner shakes hands first,
    the same way ggml will (TCP, no transport upgrade), and hands ggml only a worker
    that has answered well."""
    host, _, port = endpoint.rpartition(":")
    hello = bytes([RPC_CMD_HELLO]) + struct.pack("<Q", RPC_CONN_CAPS_SIZE) + \
        bytes(RPC_CONN_CAPS_SIZE)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            sock.sendall(hello)
            size = struct.unpack("<Q", _read(sock, 8))[0]
            if size != HELLO_REPLY.size:
                raise RunnerError(f"RPC worker {endpoint} did not answer as an RPC server "
                                  f"(a {size}-byte reply to HELLO)")
            major, minor, patch, _, _ = HELLO_REPLY.unpack(_read(sock, HELLO_REPLY.size))
    except (OSError, ValueError, struct.error) as exc:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise RunnerError(f"RPC worker {endpoint} is unreachable: {reason}") from None
    if major != RPC_PROTO_MAJOR:
        raise RunnerError(f"RPC worker {endpoint} speaks RPC protocol {major}.{minor}.{patch};"
                          f" this build speaks {RPC_PROTO_MAJOR}.x")
    return major, minor, patch


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ValueError("the connection closed during the handshake")
        data += chunk
    return data


def add_workers(endpoints: tuple[str, ...]) -> list[Worker]:
    """Register each worker's devices with ggml, so the next model load can use them."""
    if not endpoints:
        return []
    quiet_native_aborts()
    for endpoint in endpoints:
        probe(endpoint)
    ggml, rpc = _libs()
    workers = []
    for endpoint in endpoints:
        reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise RunnerError(f"RPC worker {endpoint} did not answer as an RPC server")
        ggml.ggml_backend_register(reg)
        free = total = 0
        for i in range(ggml.ggml_backend_reg_dev_count(reg)):
            dev = ggml.ggml_backend_reg_dev_get(reg, i)
            f, t = ctypes.c_size_t(0), ctypes.c_size_t(0)
            ggml.ggml_backend_dev_memory(dev, ctypes.byref(f), ctypes.byref(t))
            free, total = free + f.value, total + t.value
        workers.append(Worker(endpoint, free, total))
    return workers


def best_device(ggml: Any) -> Any:
    """A GPU if this machine has one, else the CPU: where a worker keeps its layers."""
    devices = [ggml.ggml_backend_dev_get(i) for i in range(ggml.ggml_backend_dev_count())]
    for wanted in (_GPU, _IGPU, _CPU):
        for dev in devices:
            if ggml.ggml_backend_dev_type(dev) == wanted:
                return dev
    raise RunnerError("ggml reports no device to serve")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


WARNING = ("WARNING: the RPC protocol has no authentication or encryption: anyone who can "
           "reach {endpoint} can run code on this machine's {device}. Only listen on a "
           "trusted network.")


def serve(host: str, port: int, threads: int, cache: str | None) -> None:
    """Run a worker until the process is stopped (the call never returns)."""
    from corral.config import load_settings
    from corral.process import apply_native_defaults

    apply_native_defaults(load_settings(warn=False).deterministic)
    ggml, rpc = _libs()
    dev = best_device(ggml)
    name = ggml.ggml_backend_dev_name(dev).decode()
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not is_loopback(host):
        print(WARNING.format(endpoint=endpoint, device=name), file=sys.stderr, flush=True)
    if cache:
        os.makedirs(cache, exist_ok=True)
    devices = (ctypes.c_void_p * 1)(dev)
    rpc.ggml_backend_rpc_start_server(endpoint.encode(), cache.encode() if cache else None,
                                      threads or os.cpu_count() or 1, 1, devices)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="corral rpc-server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--cache", default=None, help="tensor cache directory (off unless set)")
    args = parser.parse_args(argv)
    try:
        serve(args.host, args.port, args.threads, args.cache)
    except RunnerError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
