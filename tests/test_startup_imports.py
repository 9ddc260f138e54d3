"""What a cold `corral run` waits for: the modules imported before a model starts loading.

The budget is a benchmark (`benchmarks/latency.py`); these tests keep the
structure that makes it: the daemon reaches its first runner spawn without the
HTTP stack, and the runner process never loads llama-cpp-python's high-level
layer (numpy and jinja2 come later, while the model loads).
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def imported_after(code: str) -> set[str]:
    probe = code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return set(out.split())


def test_daemon_spawns_its_first_runner_before_the_http_stack_is_imported() -> None:
    mods = imported_after("import corral.server.daemon")
    assert not {"httpx", "uvicorn", "starlette", "anyio", "llama_cpp", "numpy",
                "rich", "corral.registry.download", "corral.server.asgi", "pydantic",
                "prometheus_client"} & mods


@pytest.mark.model
def test_runner_entry_loads_only_the_c_bindings() -> None:
    mods = imported_after("from corral.runner import capi\ncapi.install()\n"
                          "import corral.runner.process")
    assert "llama_cpp.llama_cpp" in mods
    assert "llama_cpp.llama" not in mods and "llama_cpp.llama_chat_format" not in mods


@pytest.mark.model
def test_bare_package_has_the_bindings_and_its_submodules() -> None:
    code = ("from corral.runner import capi\nL = capi.install()\n"
            "assert L.llama_decode is L.llama_cpp.llama_decode\n"
            "import llama_cpp.llama_grammar\nassert capi.install() is L")
    subprocess.run([sys.executable, "-c", code], timeout=60, check=True)


def test_json_schema_grammar_leaves_llama_cpp_out_of_the_daemon() -> None:
    # `import llama_cpp.llama_grammar` would run the package's __init__: libllama,
    # numpy and jinja2 resident in the daemon for good after one JSON-schema request.
    mods = imported_after("from corral.server.pipeline.grammar import grammar_for\n"
                          "assert 'root' in grammar_for({'type': 'object'}, 1 << 16)\n"
                          "assert 'root' in grammar_for('json', 1 << 16)")
    assert not {"llama_cpp", "numpy", "jinja2"} & mods


def test_concurrent_first_grammar_conversions_wait_for_one_load() -> None:
    # The soak found it: sixteen clients' first JSON-schema requests at once, and one
    # saw the module while its body was still running ("has no attribute").
    code = """
import threading
from corral.runner.capi import pure_module
from corral.server.pipeline.grammar import grammar_for
errors = []
start = threading.Barrier(8)
def convert():
    start.wait()
    try:
        grammar_for({"type": "object", "properties": {"a": {"type": "integer"}}}, 65536)
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=convert) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
"""
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        assert out.strip() == "[]", out
