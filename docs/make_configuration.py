"""Writes docs/configuration.md from the settings table, `corral.config.SPECS`.

    .venv/bin/python docs/make_configuration.py

The table is the one `corral serve --help` prints, so the page cannot drift from what
the daemon reads; tests/test_docs.py fails when the committed page differs from what
this writes. The notes below the table say what a one-line meaning cannot.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from corral.config import SPECS

PAGE = Path(__file__).resolve().parent / "configuration.md"

HEAD = """\
# Configuration

<!-- Generated from corral/config.py by docs/make_configuration.py: edit those, not this. -->

Every setting is read once, from `CORRAL_<NAME>` or, as a fallback, `OLLAMA_<NAME>`
(so `OLLAMA_HOST` and the rest of an Ollama setup keep working). An invalid value logs a warning and the default is used.
A switch (`true`/`false` below) takes `on`, `yes`, `1`, `t`, `true` or `off`, `no`, `0`,
`f`, `false`, and any other value is invalid. Under the `OLLAMA_` name of a setting Ollama
has too (`FLASH_ATTENTION`, `NOPRUNE`, `NOHISTORY`) it follows Ollama's rule instead (Go's
`strconv.ParseBool`, and any value that does not parse counts as true), so that
`OLLAMA_FLASH_ATTENTION=enabled` means what it means to Ollama.
`corral serve --help` prints this table too.

| variable | default | meaning |
|---|---|---|
"""

NOTES = """
## Notes

- `CORRAL_HOST` takes every form `OLLAMA_HOST` does: `host`, `host:port`, `:port`,
  `[v6]:port` and `http(s)://` URLs; a bare domain means HTTPS on port 443. A client
  command starts the daemon when nothing answers on a loopback `CORRAL_HOST`, never on
  a remote one ([serving](serving.md#the-daemon-and-its-files)).
- `CORRAL_MODELS` is laid out as Ollama's store, so `CORRAL_MODELS=~/.ollama/models`
  serves the models Ollama pulled. The `<data dir>` is platformdirs' user data
  directory for `corral` (`~/.local/share/corral` on Linux); the state directory, which
  holds the log, the REPL history and the prompt cache's disk tier, is
  `~/.local/state/corral`.
- `CORRAL_NUM_PARALLEL` left at auto gives a model as many slots as memory fits, up
  to `CORRAL_MAX_SLOTS`, in one KV buffer they share, which commits only the pages its
  cells write; `CORRAL_NUM_PARALLEL=N` means exactly N slots from the load on
  ([serving](serving.md#memory-follows-use)). `CORRAL_KV_POOL=off`, and
  `CORRAL_DETERMINISTIC=1`, keep a KV stream per slot instead, elastic: one while a
  model is idle, growing as requests run at once. With `CORRAL_KV_POOL=on` the slots
  share one buffer of `CORRAL_KV_POOL_TOKENS` and the newest sequence is preempted when
  it fills ([pool mode](serving.md#one-batch-for-every-slot)).
- `CORRAL_SPECULATIVE` takes `on` or `off` (`yes`/`no` and `1`/`0`, `true`/`false` as
  the other switches do; anything else warns and leaves it on). The daemon reads it
  once at start and passes it to each runner as the model loads, so a change takes a
  restart; there is no per-request option. Each final response says what was drafted
  and accepted ([the API](api.md#speculative-decoding)), and `/metrics` counts both.
- `CORRAL_FLASH_ATTENTION=1` forces flash attention on and `0` off; unset, it is auto.
- `CORRAL_RUNNER_TIMEOUT`: why a minute is in [serving](serving.md#runners).
- `CORRAL_API_KEY`: `x-api-key: <key>` is accepted as well as the bearer token, as
  Anthropic's clients send it; the page at `/ui` asks for the key once per tab.
- The bounds: a body over `CORRAL_MAX_BODY` is a 413; over the embed, create, image
  and grammar bounds is a 400 that names the variable
  ([serving](serving.md#in-front-of-the-routes)).
- `CORRAL_CACHE_RAM` and `CORRAL_CACHE_DISK` take sizes as `512MiB`, `4GiB` or bytes.
  The disk tier lives under `<state dir>/kvcache`, for all models together
  ([the prompt cache](prompt-cache.md)).
- `CORRAL_RPC_SERVERS`: [running across machines](rpc.md). A Modelfile's
  `PARAMETER rpc_servers` or a request's `rpc_servers` option names workers too (`""`
  there means none).
- Two variables that are not Corral's are read as their owners define them:
  `CUDA_VISIBLE_DEVICES` (which GPUs llama.cpp may use; when it is set the daemon does
  not ask NVML for free VRAM) and llama-cpp-python's `LLAMA_CPP_LIB_PATH` (its shared
  libraries, when built apart from the package, as [the GPU check](gpu.md) does).
"""


def _cell(text: str) -> str:
    """Markdown-safe outside code spans: `<key>` would otherwise read as an HTML tag."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else
                    p.replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
                    for p in parts)


def render() -> str:
    rows = []
    for spec in SPECS:
        default = f"`{spec.shown_default}`" if spec.shown_default else "unset"
        rows.append(f"| `CORRAL_{spec.name}` | {default} | {_cell(spec.doc)} |\n")
    return HEAD + "".join(rows) + NOTES


def main() -> int:
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
