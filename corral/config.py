"""Every setting Corral reads from the environment, typed, read once, passed down.

Each setting is `CORRAL_<NAME>`, with `OLLAMA_<NAME>` as a fallback so existing
setups keep working. An invalid value warns and falls back to the default, as
Ollama does. No other module reads `os.environ`.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import platformdirs

from corral.host import DEFAULT_PORT, HostAddr, parse_host

APP = "corral"
FOREVER = -1.0  # keep-alive seconds meaning "never unload"


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_DURATION = 10 * 365 * 86400.0


def parse_duration(value: Any) -> float:
    """Seconds from a number or a Go duration ("5m", "1h30m"). Negative means forever."""
    if isinstance(value, bool):
        raise ValueError("a duration cannot be a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().strip('"').strip("'")
        try:
            seconds = float(text)
        except ValueError:
            seconds = _parse_go_duration(text)
    else:
        raise ValueError(f"invalid duration {value!r}")
    if math.isnan(seconds):
        raise ValueError("invalid duration NaN")
    if seconds < 0:
        return FOREVER
    if seconds > MAX_DURATION or math.isinf(seconds):
        return FOREVER
    return seconds


def _parse_go_duration(text: str) -> float:
    sign = 1.0
    if text[:1] in "+-" and text:
        sign = -1.0 if text[0] == "-" else 1.0
        text = text[1:]
    if text == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(text):
        m = _DURATION_PART.match(text, pos)
        if not m:
            raise ValueError(f"invalid duration {text!r}")
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    if pos == 0:
        raise ValueError("empty duration")
    return sign * total


_TRUE = {"1", "t", "true", "TRUE", "True", "T"}
_FALSE = {"0", "f", "false", "FALSE", "False", "F"}


def parse_bool(value: str) -> bool:
    """Go's ParseBool, except that any other non-empty value counts as true (as Ollama)."""
    if value in _FALSE:
        return False
    return value in _TRUE or bool(value)


def parse_switch(value: str) -> bool:
    """on/off, yes/no or one of Go's boolean spellings; anything else is invalid (and so
    warns), unlike parse_bool's Ollama rule, which would read "off" as true."""
    word = value.lower()
    if word not in ("on", "yes", "off", "no") and value not in _TRUE | _FALSE:
        raise ValueError("must be on or off")
    return word in ("on", "yes") or value in _TRUE


def _parse_auto_switch(value: str) -> bool | None:
    """A switch that may also be left to Corral: `auto` is its default (None)."""
    return None if value.lower() == "auto" else parse_switch(value)


def _parse_count(value: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError("must not be negative")
    return n


def parse_size(value: str) -> int:
    """Bytes, as a count or with a unit: 512MiB, 2GB and 2g are binary multiples."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", value.strip().lower())
    if not m:
        raise ValueError("must be a size such as 0, 512MiB or 4GiB")
    return int(float(m.group(1)) * (1 << 10 * (" kmgt".index(m.group(2) or " "))))


def _parse_context(value: str) -> int:
    n = int(value)
    if n != 0 and (n < 4 or n > 1 << 24):
        raise ValueError("must be 0 (auto) or between 4 and 16777216")
    return n


def _parse_origins(value: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in value.split(",") if o.strip())


def _parse_rpc_servers(value: str) -> tuple[str, ...]:
    from corral.errors import InvalidOption
    from corral.options import parse_rpc_servers

    try:
        return parse_rpc_servers(value)
    except InvalidOption as exc:
        raise ValueError(exc.message) from None


def _parse_kv_type(value: str) -> str:
    value = value.lower()
    if value not in ("f16", "q8_0", "q4_0"):
        raise ValueError("must be f16, q8_0 or q4_0")
    return value


def _parse_debug(value: str) -> int:
    if value.isdigit():
        return int(value)
    return 1 if parse_bool(value) else 0


def _parse_path(value: str) -> Path:
    return Path(value).expanduser()


def _parse_api_key(value: str) -> str | None:
    return value or None


@dataclass(frozen=True)
class Spec:
    name: str
    attr: str
    default: Any
    shown_default: str
    doc: str
    parse: Callable[[str], Any]


def data_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP, appauthor=False))


def state_dir() -> Path:
    return Path(platformdirs.user_state_dir(APP, appauthor=False))


def cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir(APP, appauthor=False))


SPECS: tuple[Spec, ...] = (
    Spec("HOST", "host", parse_host(f"127.0.0.1:{DEFAULT_PORT}"), f"127.0.0.1:{DEFAULT_PORT}",
         "address the daemon binds and the CLI talks to", parse_host),
    Spec("MODELS", "models", None, "<data dir>/models", "model store directory", _parse_path),
    Spec("KEEP_ALIVE", "keep_alive", 300.0, "5m",
         "how long an idle model stays loaded (negative: forever)", parse_duration),
    Spec("NUM_PARALLEL", "num_parallel", 0, "auto",
         "parallel slots per model (0: auto, as many as memory fits, up to MAX_SLOTS)",
         _parse_count),
    Spec("MAX_SLOTS", "max_slots", 0, "auto",
         "most slots auto mode gives a model (0: 16 on the CPU, 32 on a GPU)", _parse_count),
    Spec("KV_POOL", "kv_pool", None, "auto",
         "on: slots share a KV pool of KV_POOL_TOKENS, num_ctx caps a sequence (preempting "
         "when it fills); off: a KV stream per slot; auto: one buffer of every slot's "
         "num_ctx (a stream per slot under DETERMINISTIC)", _parse_auto_switch),
    Spec("KV_POOL_TOKENS", "kv_pool_tokens", 0, "auto",
         "KV pool size in tokens (0: MAX_SLOTS x num_ctx, as memory allows)", _parse_count),
    Spec("DETERMINISTIC", "deterministic", False, "false",
         "batch-invariant kernels: greedy output never depends on what shares the batch",
         parse_switch),
    Spec("SPECULATIVE", "speculative", True, "on", "speculative decoding: draft tokens from "
         "the context, verify them in the batch (exact; off: one token per step)",
         parse_switch),
    Spec("MAX_LOADED_MODELS", "max_loaded_models", 0, "auto",
         "most models loaded at once (0: auto)", _parse_count),
    Spec("MAX_QUEUE", "max_queue", 512, "512", "most pending requests before 503", _parse_count),
    Spec("CONTEXT_LENGTH", "context_length", 0, "auto", "default num_ctx per slot (0: the "
         "model's trained length, up to 256k, as one slot of it fits in memory)",
         _parse_context),
    Spec("ORIGINS", "origins", (), "", "extra allowed CORS origins, comma separated",
         _parse_origins),
    Spec("FLASH_ATTENTION", "flash_attention", None, "auto", "force flash attention on or off",
         parse_switch),
    Spec("KV_CACHE_TYPE", "kv_cache_type", "f16", "f16", "KV cache type: f16, q8_0, q4_0",
         _parse_kv_type),
    Spec("NOPRUNE", "noprune", False, "false", "do not prune unused blobs on start", parse_switch),
    Spec("NOHISTORY", "nohistory", False, "false", "do not save REPL history", parse_switch),
    Spec("DEBUG", "debug", 0, "0", "debug logging (1) and tracebacks; 2 for trace", _parse_debug),
    Spec("LOAD_TIMEOUT", "load_timeout", 300.0, "5m",
         "give up on a model load after this long (negative: never)", parse_duration),
    Spec("RUNNER_TIMEOUT", "runner_timeout", 60.0, "1m",
         "a runner that answers no health check this long while requests need it is "
         "killed and replaced", parse_duration),
    Spec("STEP_TIMEOUT", "step_timeout", 300.0, "5m",
         "a runner whose engine stays this long inside one step (a stopped RPC worker, a "
         "hung GPU) ends its requests with an error and is replaced (0: no bound)",
         parse_duration),
    Spec("API_KEY", "api_key", None, "", "require 'Authorization: Bearer <key>' when set",
         _parse_api_key),
    # Bounds on the work one request may ask for; over a bound is a 400 (413 for bodies).
    Spec("MAX_BODY", "max_body", 16 << 20, "16777216", "largest JSON request body, bytes",
         _parse_count),
    Spec("MAX_HEADER_BYTES", "max_header_bytes", 64 << 10, "65536",
         "largest request head (all headers), bytes", _parse_count),
    Spec("HEADER_TIMEOUT", "header_timeout", 10.0, "10s",
         "a connection must send a whole request head within this", parse_duration),
    Spec("MAX_EMBED_INPUTS", "max_embed_inputs", 2048, "2048", "most inputs in one embed request",
         _parse_count),
    Spec("MAX_EMBED_TOKENS", "max_embed_tokens", 1 << 20, "1048576",
         "most tokens, all inputs together, in one embed request", _parse_count),
    Spec("MAX_CREATE_FILES", "max_create_files", 64, "64", "most `files` entries in one create",
         _parse_count),
    Spec("MAX_IMAGES", "max_images", 16, "16",
         "most images and audio clips, together, in one request", _parse_count),
    Spec("MAX_IMAGE_BYTES", "max_image_bytes", 20 << 20, "20971520",
         "largest image, bytes (decoded from base64)", _parse_count),
    Spec("MAX_IMAGE_PIXELS", "max_image_pixels", 50_000_000, "50000000",
         "most pixels in one image (width x height), read from its header before decoding",
         _parse_count),
    Spec("MAX_AUDIO_BYTES", "max_audio_bytes", 20 << 20, "20971520",
         "largest audio clip, bytes (decoded from base64, or one upload's file)", _parse_count),
    Spec("MAX_AUDIO_SECONDS", "max_audio_seconds", 600.0, "10m",
         "longest audio clip, read from its header before decoding", parse_duration),
    Spec("RPC_SERVERS", "rpc_servers", (), "",
         "llama.cpp RPC workers (`corral rpc-server`) to spread layers over: host:port,...",
         _parse_rpc_servers),
    Spec("MAX_GRAMMAR_BYTES", "max_grammar_bytes", 64 << 10, "65536",
         "largest grammar or JSON schema in `format`, bytes", _parse_count),
    Spec("CACHE_RAM", "cache_ram", None, "auto", "host RAM for each model's prompt cache "
         "(0: off; auto: an eighth of RAM, at most 4GiB)", parse_size),
    Spec("CACHE_DISK", "cache_disk", 0, "0", "disk for the prompt cache under the state "
         "directory, so prompts stay warm across unloads and restarts (0: off)", parse_size),
)


# Switches that Ollama has too (envconfig.Bool): their OLLAMA_ names follow its rule.
OLLAMA_SWITCHES = frozenset({"FLASH_ATTENTION", "NOPRUNE", "NOHISTORY"})


@dataclass(frozen=True)
class Settings:
    host: HostAddr
    models: Path
    keep_alive: float
    num_parallel: int
    max_slots: int
    kv_pool: bool | None  # None: auto (Settings.shared_kv)
    kv_pool_tokens: int
    deterministic: bool
    speculative: bool
    max_loaded_models: int
    max_queue: int
    context_length: int
    origins: tuple[str, ...]
    flash_attention: bool | None
    kv_cache_type: str
    noprune: bool
    nohistory: bool
    debug: int
    load_timeout: float
    runner_timeout: float
    step_timeout: float
    api_key: str | None
    max_body: int
    max_header_bytes: int
    header_timeout: float
    max_embed_inputs: int
    max_embed_tokens: int
    max_create_files: int
    max_images: int
    max_image_bytes: int
    max_image_pixels: int
    max_audio_bytes: int
    max_audio_seconds: float
    rpc_servers: tuple[str, ...]
    max_grammar_bytes: int
    cache_ram: int | None
    cache_disk: int
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def shared_kv(self) -> bool:
        """The default layout: the slots share one KV buffer sized for every slot's
        num_ctx, so each still has its whole context (nothing is preempted); a KV stream
        per slot under DETERMINISTIC, whose exactness a shared buffer cannot promise."""
        return self.kv_pool is None and not self.deterministic


def llama_lib_path() -> str | None:
    """llama-cpp-python's own LLAMA_CPP_LIB_PATH: its shared libraries, when they are built
    apart from the package (a CUDA build made on the spot, as the GPU check does)."""
    return os.environ.get("LLAMA_CPP_LIB_PATH") or None


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES, when set: which GPUs CUDA (and so llama.cpp) may use."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with `extra` on top: what `corral launch` runs an agent
    with (its settings for that run, the user's own configuration untouched)."""
    return {**os.environ, **extra}


def load_settings(environ: Mapping[str, str] | None = None, warn: bool = True) -> Settings:
    """Read every setting once. Invalid values warn and fall back to the default."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    problems: list[str] = []
    for spec in SPECS:
        raw, source = None, ""
        for prefix in ("CORRAL_", "OLLAMA_"):
            if (prefix + spec.name) in env:
                raw, source = env[prefix + spec.name], prefix + spec.name
                break
        value = spec.default
        # A switch reads one way (parse_switch: anything else warns), but under the name of
        # one of Ollama's own settings by Ollama's rule: a setup made for it means the same.
        parse = parse_bool if spec.name in OLLAMA_SWITCHES and source.startswith("OLLAMA_") \
            else spec.parse
        if raw is not None:
            text = raw.strip().strip('"').strip("'")
            if text:
                try:
                    value = parse(text)
                except (ValueError, OverflowError) as exc:
                    problems.append(f"invalid {source}={raw!r} ({exc}); using {spec.shown_default}")
        values[spec.attr] = value
    if values["models"] is None:
        values["models"] = data_dir() / "models"
    for problem in problems if warn else []:
        logging.getLogger("corral").warning(problem)
    return Settings(**values, warnings=tuple(problems))


def describe_settings() -> str:
    """Help text that lists every variable with its default (for `corral serve --help`)."""
    # "\b" keeps click from re-wrapping the table.
    lines = ["\b", "Environment variables (CORRAL_*; OLLAMA_* accepted as a fallback):"]
    for spec in SPECS:
        lines.append(f"  CORRAL_{spec.name:<18} {spec.doc} (default: {spec.shown_default or 'unset'})")
    return "\n".join(lines)
