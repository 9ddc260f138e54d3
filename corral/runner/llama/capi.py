"""llama.cpp's C API from llama-cpp-python, without its high-level layer.

`import llama_cpp` runs the package's `__init__`, which also imports its
`Llama` class and chat formats: numpy, jinja2 and a dozen modules, about a
tenth of a second that a cold `corral run` waits for. The runner process needs
only the ctypes bindings, so its entry point (`runner/__main__.py`) registers
a bare `llama_cpp` package holding exactly those names before anything imports
it. Submodules (`llama_cpp.llama_grammar`, `llama_cpp.mtmd_cpp`) still import
normally from the package's path.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import types


def install() -> types.ModuleType:
    """Make `import llama_cpp` yield the C bindings only; a no-op once it is imported."""
    if "llama_cpp" in sys.modules:
        return sys.modules["llama_cpp"]
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("llama-cpp-python is not installed")
    package = types.ModuleType("llama_cpp")
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    package.__spec__ = spec
    sys.modules["llama_cpp"] = package
    try:
        bindings = importlib.import_module("llama_cpp.llama_cpp")
    except BaseException:
        del sys.modules["llama_cpp"]
        raise
    # What the package's own `from .llama_cpp import *` would bind.
    package.__dict__.update({k: v for k, v in vars(bindings).items() if not k.startswith("_")})
    package.llama_cpp = bindings  # type: ignore[attr-defined]
    return package


def pure_module(name: str) -> types.ModuleType:
    """A pure-Python submodule of llama-cpp-python (`llama_grammar`) loaded on its own.

    Its package's `__init__` would load libllama, numpy and jinja2 into the
    daemon, tens of megabytes that a JSON-schema conversion does not need.
    Concurrent first calls wait for one load: a module is in `sys.modules`
    while its body runs, and a second thread must not use it half-made.
    """
    key = f"_corral_llama_cpp_{name}"
    with _pure_lock:
        if key in sys.modules:
            return sys.modules[key]
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("llama-cpp-python is not installed")
        path = os.path.join(list(spec.submodule_search_locations)[0], f"{name}.py")
        module_spec = importlib.util.spec_from_file_location(key, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"llama_cpp.{name} is missing")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[key] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
        return module


_pure_lock = threading.Lock()
