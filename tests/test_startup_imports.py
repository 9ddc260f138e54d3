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


# What the daemon loads of the runner, every server module imported: the contract at the
# top of corral/runner/ and, below it, only the entry points tests/test_layers.py names
# (DAEMON_REACHES). Nothing that runs in the runner process, and so no llama.cpp.
DAEMON_RUNNER_MODULES = {
    "corral.runner", "corral.runner.client", "corral.runner.wire", "corral.runner.rankwire",
    "corral.runner.fim", "corral.runner.loadconfig", "corral.runner.fitestimate",
    "corral.runner.layerkinds",  # the fit's reading of a hybrid's layers, pure
    "corral.runner.tools", "corral.runner.tools.quantize",  # quantize_in_child
    "corral.runner.tools.probe",  # probe_in_child
    "corral.runner.llama", "corral.runner.llama.capi",  # pure_module: grammar conversion
}


def test_the_daemon_loads_the_runners_contract_and_nothing_of_its_process() -> None:
    mods = imported_after(
        "import importlib, pkgutil, corral.server\n"
        "for m in pkgutil.walk_packages(corral.server.__path__, 'corral.server.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)")
    assert {m for m in mods if m.startswith("corral.runner")} == DAEMON_RUNNER_MODULES
    assert "llama_cpp" not in mods


@pytest.mark.model
def test_runner_entry_loads_only_the_c_bindings() -> None:
    mods = imported_after("from corral.runner.llama import capi\ncapi.install()\n"
                          "import corral.runner.process.main")
    assert "llama_cpp.llama_cpp" in mods
    assert "llama_cpp.llama" not in mods and "llama_cpp.llama_chat_format" not in mods


@pytest.mark.model
def test_bare_package_has_the_bindings_and_its_submodules() -> None:
    code = ("from corral.runner.llama import capi\nL = capi.install()\n"
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
from corral.runner.llama.capi import pure_module
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
