"""The option table and option coercion.

One table types Modelfile PARAMETERs, request `options`, and the CLI's
`/set parameter`, so all three accept and refuse exactly the same values.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional

from corral.errors import InvalidOption

# name -> (type, kind); kind "load" options force a reload when they change.
OPTION_TYPES: dict[str, tuple[type, str]] = {
    "num_ctx": (int, "load"),
    "num_batch": (int, "load"),
    "num_gpu": (int, "load"),
    "main_gpu": (int, "load"),
    "use_mmap": (bool, "load"),
    "num_thread": (int, "load"),
    "draft_num_predict": (int, "load"),
    "rpc_servers": (str, "load"),  # Corral extension: llama.cpp RPC workers, host:port,...
    "num_keep": (int, "request"),
    "seed": (int, "request"),
    "num_predict": (int, "request"),
    "top_k": (int, "request"),
    "top_p": (float, "request"),
    "min_p": (float, "request"),
    "typical_p": (float, "request"),
    "repeat_last_n": (int, "request"),
    "temperature": (float, "request"),
    "repeat_penalty": (float, "request"),
    "presence_penalty": (float, "request"),
    "frequency_penalty": (float, "request"),
    "stop": (list, "request"),
    "ignore_eos": (bool, "request"),  # Corral extension, for benchmarks
}
LOAD_OPTIONS = frozenset(k for k, (_, kind) in OPTION_TYPES.items() if kind == "load")

# Sent by old clients (and ollama-python's Options type); accepted and ignored.
IGNORED_OPTIONS = frozenset({
    "numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock", "embedding_only",
    "num_gqa", "rope_frequency_base", "rope_frequency_scale", "tfs_z", "mirostat",
    "mirostat_tau", "mirostat_eta", "penalize_newline",
})

_I32 = (1 << 31) - 1


def _range(lo: float, hi: float) -> Callable[[float], bool]:
    return lambda v: lo <= v <= hi


# Checked before anything reaches native code.
_RANGES: dict[str, Callable[[Any], bool]] = {
    "num_ctx": _range(4, 1 << 24),
    "num_batch": _range(1, 1 << 16),
    "num_gpu": _range(-1, 1 << 16),
    "main_gpu": _range(0, 255),
    "num_thread": _range(0, 1024),
    "draft_num_predict": _range(0, 64),
    "num_keep": _range(-1, _I32),
    "seed": _range(-(1 << 63), (1 << 64) - 1),
    "num_predict": _range(-2, _I32),
    "top_k": _range(0, _I32),
    "top_p": _range(0.0, 1.0),
    "min_p": _range(0.0, 1.0),
    "typical_p": _range(0.0, 1.0),
    "repeat_last_n": _range(-1, _I32),
    "temperature": _range(0.0, 100.0),
    "repeat_penalty": _range(0.0, 100.0),
    "presence_penalty": _range(-100.0, 100.0),
    "frequency_penalty": _range(-100.0, 100.0),
}

MAX_STOPS = 64
MAX_STOP_LEN = 1024


def coerce_option(name: str, value: Any) -> Any:
    """Type and range-check one option value; returns the normalised value."""
    if name not in OPTION_TYPES:
        raise InvalidOption(f"unknown parameter '{name}'")
    kind = OPTION_TYPES[name][0]
    if kind is list:
        return _coerce_stop(value)
    if name == "rpc_servers":
        if not isinstance(value, str):
            raise InvalidOption("option 'rpc_servers' must be a string of host:port,...")
        return ",".join(parse_rpc_servers(value))
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise InvalidOption(f"option {name!r} must be a boolean")
    if isinstance(value, bool):
        raise InvalidOption(f"option {name!r} must be a number")
    try:
        number: float = float(value) if kind is float else _to_int(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidOption(f"option {name!r} must be a number") from None
    if isinstance(number, float) and not math.isfinite(number):
        raise InvalidOption(f"option {name!r} must be finite")
    check = _RANGES.get(name)
    if check is not None and not check(number):
        raise InvalidOption(f"option {name!r} is out of range: {value!r}")
    return number


MAX_RPC_SERVERS = 16  # GGML_RPC_MAX_SERVERS
_ENDPOINT = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\]):(\d{1,5})")


def parse_rpc_servers(value: str) -> tuple[str, ...]:
    """`host:port,host:port` -> the endpoints, each checked; empty means none."""
    endpoints = tuple(e.strip() for e in value.split(",") if e.strip())
    if len(endpoints) > MAX_RPC_SERVERS:
        raise InvalidOption(f"at most {MAX_RPC_SERVERS} RPC servers")
    for endpoint in endpoints:
        match = _ENDPOINT.fullmatch(endpoint)
        if match is None or not 0 < int(match.group(1)) < 65536:
            raise InvalidOption(f"RPC server {endpoint[:80]!r} is not host:port")
    return endpoints


def _to_int(value: Any) -> int:
    """JSON numbers are accepted for ints, truncated, as Ollama does."""
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return int(float(value))
    if isinstance(value, float):
        return int(value)
    raise TypeError("not a number")


def _coerce_stop(value: Any) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidOption("option 'stop' must be a list of strings")
    if len(items) > MAX_STOPS or any(len(s) > MAX_STOP_LEN for s in items):
        raise InvalidOption("option 'stop' has too many or too long entries")
    return [s for s in items if s]


def coerce_options(options: Any, strict: bool = False) -> dict[str, Any]:
    """Validate an options object. Unknown keys are dropped unless `strict`; nulls skipped."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InvalidOption("options must be an object")
    out: dict[str, Any] = {}
    for name, value in options.items():
        if value is None or name in IGNORED_OPTIONS:
            continue
        if name not in OPTION_TYPES and not strict:
            continue
        out[name] = coerce_option(name, value)
    return out


@dataclass(frozen=True)
class Options:
    """Coerced options, None where nobody set one. The request path carries this record
    from the model's view to the scheduler (the load fields) and the runner's job (the
    sampling fields); only the edges see JSON. Layers merge with `over`."""

    num_ctx: Optional[int] = None
    num_batch: Optional[int] = None
    num_gpu: Optional[int] = None
    main_gpu: Optional[int] = None
    use_mmap: Optional[bool] = None
    num_thread: Optional[int] = None
    draft_num_predict: Optional[int] = None
    rpc_servers: Optional[str] = None
    num_keep: Optional[int] = None
    seed: Optional[int] = None
    num_predict: Optional[int] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    typical_p: Optional[float] = None
    repeat_last_n: Optional[int] = None
    temperature: Optional[float] = None
    repeat_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stop: Optional[tuple[str, ...]] = None
    ignore_eos: Optional[bool] = None

    @classmethod
    def parse(cls, raw: Any, strict: bool = False) -> "Options":
        """An options object from JSON (or a Modelfile's PARAMETERs), checked."""
        values = coerce_options(raw, strict)
        if "stop" in values:
            values["stop"] = tuple(values["stop"])
        return cls(**values)

    def _set(self) -> dict[str, Any]:
        """The options set here, by name, as the record holds them."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if v is not None}

    def over(self, base: "Options") -> "Options":
        """These options layered over `base`: what is set here wins."""
        return replace(base, **self._set())

    def values(self) -> dict[str, Any]:
        """The set options by name, as JSON carries them."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._set().items()}

    def load(self) -> "Options":
        """Only the load-time options: those that need a reload when they change."""
        return Options(**{k: v for k, v in self._set().items() if k in LOAD_OPTIONS})

    def differs(self, loaded: "Options") -> bool:
        """An option set here differs from `loaded`'s (a load needs a reload)."""
        return any(getattr(loaded, k) != v for k, v in self._set().items())
