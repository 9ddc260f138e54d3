"""Dependencies run one way: corral <- registry <- runner <- server <- cli, and cli -> api -> corral.

Every import of every module is read with `ast`, including imports inside
functions, so a lazy import cannot hide an arrow pointing the wrong way. Each layer
is a subpackage `corral/<layer>/` (the foundation is the modules of `corral` itself),
so an import names its layer by its second part; a bare `server` or `runner` import
names no package of ours, and is a violation too.

Inside the runner the same holds between its folders: the top of `corral/runner/` is
the contract with the daemon and the types the folders share, and imports no folder;
each folder imports only those below it. The daemon imports the top, and of the
folders only the few entry points named in DAEMON_REACHES.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "corral"

# package -> the packages of ours it may import (besides itself)
ALLOWED: dict[str, frozenset[str]] = {
    "corral": frozenset(),
    "registry": frozenset({"corral"}),
    "runner": frozenset({"corral", "registry"}),
    "api": frozenset({"corral"}),
    "server": frozenset({"corral", "registry", "runner", "api"}),
    "cli": frozenset({"corral", "api", "registry", "server"}),
}
# The CLI reaches the server only to run it (`corral serve`); everything else goes
# through the client. These are the only cli modules and functions that may.
CLI_SERVER_USERS = {("cli/main.py", "serve")}


LAYERS = frozenset({"registry", "runner", "server", "api", "cli"})


def layer_of(module: str) -> str:
    """`corral.server.http` is the server layer, `corral.config` the foundation; a bare
    `server.http` comes back as "bare server", which no layer may import."""
    parts = module.split(".")
    if parts[0] == "corral":
        return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "corral"
    return f"bare {parts[0]}" if parts[0] in LAYERS else parts[0]


def imports_of(path: Path) -> list[tuple[str, int, str]]:
    """(imported layer, line, enclosing function or '') for every import."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, func or child.name)
                continue
            if isinstance(child, ast.Import):
                found.extend((layer_of(a.name), child.lineno, func) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                if child.module == "corral":  # `from corral import runner` names the layer
                    found.extend((layer_of(f"corral.{a.name}"), child.lineno, func)
                                 for a in child.names)
                else:
                    found.append((layer_of(child.module), child.lineno, func))
            visit(child, func)

    visit(tree, "")
    return found


def modules_of(root: Path, package: str) -> list[Path]:
    """The foundation is corral/*.py; a layer is everything under corral/<layer>/."""
    if package == "corral":
        return sorted(root.glob("*.py"))
    return sorted((root / package).rglob("*.py"))


def violations(root: Path) -> list[str]:
    bad = []
    for package, allowed in ALLOWED.items():
        for path in modules_of(root, package):
            rel = path.relative_to(root).as_posix()
            for target, line, func in imports_of(path):
                if target.startswith("bare "):
                    bad.append(f"{rel}:{line} imports {target[5:]} outside the corral namespace")
                    continue
                if target not in ALLOWED or target == package:
                    continue
                if target not in allowed:
                    bad.append(f"{rel}:{line} imports {target}")
                elif package == "cli" and target == "server" and (rel, func) not in CLI_SERVER_USERS:
                    bad.append(f"{rel}:{line} imports server outside `serve`")
    return bad


def test_every_import_points_down() -> None:
    assert violations(ROOT) == []


def test_every_package_is_in_the_table() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} | {"corral"}
    assert packages == set(ALLOWED)


@pytest.mark.parametrize("package,line", [
    ("corral", "from corral.registry.store import Store"),
    ("registry", "def f():\n    from corral.runner.engine.engine import Engine\n"),
    ("runner", "import corral.server.daemon"),
    ("runner", "from corral import server"),
    ("api", "from corral.server.http import Handler"),
    ("cli", "def run():\n    from corral.server.daemon import Daemon\n"),
    ("server", "from runner.engine.engine import Engine"),  # bare: works only from a checkout
])
def test_a_forbidden_import_is_caught(tmp_path: Path, package: str, line: str) -> None:
    for name in LAYERS:
        (tmp_path / name).mkdir()
    where = tmp_path if package == "corral" else tmp_path / package
    (where / "bad.py").write_text(line + "\n")
    assert len(violations(tmp_path)) == 1


def test_serve_may_import_the_server(tmp_path: Path) -> None:
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / "cli" / "main.py").write_text(
        "def serve():\n    from corral.server.daemon import Daemon\n")
    assert violations(tmp_path) == []


# ---- the runner's folders ---------------------------------------------------------------

RUNNER = ROOT / "runner"
TOP = ""  # the modules at the top of corral/runner/: the daemon's contract, shared types
# runner folder -> the runner folders it may import (besides itself)
RUNNER_ALLOWED: dict[str, frozenset[str]] = {
    TOP: frozenset(),
    "llama": frozenset({TOP}),
    "slots": frozenset({TOP, "llama", "speculative"}),
    "kv": frozenset({TOP, "llama", "slots"}),
    "cache": frozenset({TOP, "llama", "slots", "kv"}),
    "speculative": frozenset({TOP}),
    "engine": frozenset({TOP, "llama", "slots", "kv", "cache", "speculative"}),
    "tools": frozenset({TOP, "llama"}),
    "process": frozenset({TOP, "llama", "slots", "kv", "cache", "speculative", "engine",
                          "tools"}),
}
# `python -m corral.runner`: the process's entry, the one module at the top that imports
# what runs in the process (the bindings, then the load, then the rest).
RUNNER_ENTRY = "__main__.py"
# What the daemon reaches below the top: children it starts, and llama-cpp-python's
# grammar converter, a pure Python module (loaded without the bindings).
DAEMON_REACHES = frozenset({"corral.runner.tools.quantize", "corral.runner.tools.probe",
                            "corral.runner.llama.capi"})


def module_name(root: Path, path: Path) -> str:
    parts = ["corral", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runner_targets(root: Path, path: Path) -> list[tuple[str, int]]:
    """(module of corral.runner, line) for every import of one, relative ones resolved;
    `from corral.runner.llama import native` names corral.runner.llama.native."""
    here = module_name(root, path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found.extend((f"{base}.{a.name}", node.lineno) for a in node.names)
    return [(name, line) for name, line in found
            if name == "corral.runner" or name.startswith("corral.runner.")]


def folder_of(module: str) -> str:
    """corral.runner.engine.placer -> engine; corral.runner.wire (a top module) -> TOP."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in RUNNER_ALLOWED else TOP


def runner_violations(root: Path) -> list[str]:
    bad = []
    for path in sorted((root / "runner").rglob("*.py")):
        rel = path.relative_to(root / "runner")
        folder = rel.parts[0] if len(rel.parts) > 1 else TOP
        if rel.as_posix() == RUNNER_ENTRY:
            continue
        if folder not in RUNNER_ALLOWED:
            bad.append(f"runner/{rel.as_posix()}: runner/{folder}/ is not in RUNNER_ALLOWED")
            continue
        for target, line in runner_targets(root, path):
            to = folder_of(target)
            if to != folder and to not in RUNNER_ALLOWED[folder]:
                bad.append(f"runner/{rel.as_posix()}:{line} imports {target}")
    return bad


def daemon_reaches(root: Path) -> list[str]:
    """The daemon's imports of a runner module below the top, other than DAEMON_REACHES."""
    bad = []
    for package in ("server", "cli", "api"):
        for path in modules_of(root, package):
            for target, line in runner_targets(root, path):
                module = ".".join(target.split(".")[:4])  # corral.runner.<folder>.<module>
                if folder_of(target) != TOP and module not in DAEMON_REACHES:
                    bad.append(f"{path.relative_to(root).as_posix()}:{line} imports {module}")
    return bad


def test_every_runner_import_points_down() -> None:
    assert runner_violations(ROOT) == []


def test_every_runner_folder_is_in_the_table() -> None:
    folders = {p.parent.name for p in RUNNER.glob("*/__init__.py")} | {TOP}
    assert folders == set(RUNNER_ALLOWED)


def test_the_daemon_imports_the_runners_contract_and_its_entry_points_only() -> None:
    assert daemon_reaches(ROOT) == []


@pytest.mark.parametrize("where,line", [
    ("wire.py", "from corral.runner.engine.engine import Engine"),  # the contract, up
    ("jobs.py", "def f():\n    from corral.runner.llama import native\n"),
    ("llama/bad.py", "from corral.runner.slots.slot import Slot"),
    ("kv/bad.py", "from corral.runner.cache import promptcache"),
    ("cache/bad.py", "from ..engine.placer import Placer"),  # relative, resolved
    ("engine/bad.py", "import corral.runner.process.main"),
    ("tools/bad.py", "from corral.runner.engine import kvops"),
    ("llama/bad.py", "from corral.runner import tools"),
])
def test_a_forbidden_runner_import_is_caught(tmp_path: Path, where: str, line: str) -> None:
    for folder in RUNNER_ALLOWED:
        (tmp_path / "runner" / folder).mkdir(parents=True, exist_ok=True)
    (tmp_path / "runner" / where).write_text(line + "\n")
    assert len(runner_violations(tmp_path)) == 1


def test_the_daemon_reaching_into_the_engine_is_caught(tmp_path: Path) -> None:
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / "server" / "bad.py").write_text(
        "from corral.runner.wire import MARKER\n"  # the contract: allowed
        "from corral.runner.tools.quantize import quantize_in_child\n"  # an entry point
        "from corral.runner.engine.kvpool import KVPool\n")
    assert daemon_reaches(tmp_path) == ["server/bad.py:3 imports corral.runner.engine.kvpool"]


# Inside the server, three rooms and the shell over them. The chat domain (`chat/`:
# messages, the model's view, prompts and templates, the reply parser) and model
# residency (`residency/`: the scheduler, the memory fit, the cores' shares) import
# nothing else of the server; the request pipeline (`pipeline/`) works with both and
# ends at events; the shell on top (the server's own modules, the transport, the
# daemon, and the routes in `dialects/`) may import any of them. No room imports the
# shell, so the pipeline runs without an HTTP module.
SERVER_ROOMS: dict[str, frozenset[str]] = {
    "chat": frozenset(),
    "residency": frozenset(),
    "pipeline": frozenset({"chat", "residency"}),
    "shell": frozenset({"chat", "residency", "pipeline"}),
}
SHELL_PACKAGES = frozenset({"dialects"})  # subpackages of the server that are the shell


def room_of(module: str) -> str | None:
    """`corral.server.chat.reply` is the chat room, `corral.server.http` and
    `corral.server.dialects.openai` the shell; None is outside the server."""
    parts = module.split(".")
    if parts[:2] != ["corral", "server"]:
        return None
    if len(parts) > 2 and parts[2] in SERVER_ROOMS and parts[2] != "shell":
        return parts[2]
    return "shell"


def server_imports_of(path: Path) -> list[tuple[str, int]]:
    """(imported room, line) for every import of the server, lazy ones included."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from corral.server import pipeline` names the room, as `from corral import`
            # names the layer
            names = ([f"{node.module}.{a.name}" for a in node.names]
                     if node.module in ("corral", "corral.server") else [node.module])
        else:
            continue
        found.extend((room, node.lineno) for name in names
                     if (room := room_of(name)) is not None)
    return found


def server_violations(root: Path) -> list[str]:
    bad = []
    for path in sorted((root / "server").rglob("*.py")):
        rel = path.relative_to(root / "server")
        first = rel.parts[0] if len(rel.parts) > 1 else ""
        room = first if first in SERVER_ROOMS else "shell"
        for target, line in server_imports_of(path):
            if target != room and target not in SERVER_ROOMS[room]:
                bad.append(f"server/{rel.as_posix()}:{line} ({room}) imports the {target}")
    return bad


def test_the_server_rooms_point_down() -> None:
    assert server_violations(ROOT) == []


def test_every_server_package_has_a_room() -> None:
    packages = {p.parent.name for p in (ROOT / "server").glob("*/__init__.py")}
    assert packages == (set(SERVER_ROOMS) - {"shell"}) | SHELL_PACKAGES


def _server_tree(tmp_path: Path) -> Path:
    for name in ("chat", "residency", "pipeline", "dialects"):
        (tmp_path / "server" / name).mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize("room,line", [
    ("chat", "from corral.server.pipeline.request import ChatTask"),
    ("chat", "def f():\n    from corral.server.residency.scheduler import Scheduler\n"),
    ("chat", "from corral.server.http import Handler"),
    ("residency", "from corral.server.chat.models import Models"),
    ("residency", "from corral.server import pipeline"),
    ("pipeline", "from corral.server.http import Handler, Request, Route"),
    ("pipeline", "import corral.server.asgi"),
    ("pipeline", "from corral.server.dialects.stream import respond"),
    ("pipeline", "if TYPE_CHECKING:\n    from corral.server.metrics import Metrics\n"),
])
def test_a_forbidden_server_import_is_caught(tmp_path: Path, room: str, line: str) -> None:
    root = _server_tree(tmp_path)
    (root / "server" / room / "bad.py").write_text(line + "\n")
    assert len(server_violations(root)) == 1


@pytest.mark.parametrize("where,line", [
    ("pipeline", "from corral.server.chat.messages import Message"),
    ("pipeline", "from corral.server.residency.resident import Resident"),
    ("pipeline/deeper", "from corral.server.pipeline.run import run"),
    ("dialects", "from corral.server.pipeline.run import run"),
    ("", "from corral.server.dialects import openai"),
    ("", "from corral.server.residency.scheduler import Scheduler"),
])
def test_the_shell_and_the_pipeline_may_import_down(tmp_path: Path, where: str,
                                                   line: str) -> None:
    root = _server_tree(tmp_path)
    (root / "server" / where).mkdir(parents=True, exist_ok=True)
    (root / "server" / where / "good.py").write_text(line + "\n")
    assert server_violations(root) == []
