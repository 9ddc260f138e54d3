"""`corral launch`: each agent is run with the daemon, the model and its loaded context in
its environment and command line, and nothing written to the user's configuration.

The offline tests run a stand-in for each agent's binary (a script on PATH that writes
what it was given); the `network` test installs the real agents from npm and has each
finish a one-line task against the daemon, from a fresh HOME, as a user would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import ollama
import pytest

from corral.cli import agents
from corral.registry.store import Store
from corral.server.daemon import Daemon
from tests.agent_proxy import AgentProxy
from tests.test_agent_routes import AGENT, SHORT, TEMPLATE
from tests.test_cli import CORRAL, env_for

STAND_IN = """#!{python}
import json, os, sys
keep = [k for k in os.environ if k.startswith(("ANTHROPIC_", "CLAUDE_", "CODEX_CORRAL",
                                               "OPENCODE_"))]
with open({out!r}, "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": {{k: os.environ[k] for k in keep}}}}, f)
sys.exit(7)
"""


@pytest.fixture(scope="module")
def daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    from tests.support import start_daemon

    d = start_daemon(starter_store, tmp_path_factory.mktemp("launch"))
    ollama.Client(host=d.url).create(model=AGENT, from_="smollm2:135m", template=TEMPLATE,
                                     parameters=SHORT)
    yield d
    d.shutdown()


def stand_in(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A bin folder holding a stand-in `name`, and the file it writes."""
    bin_dir, out = tmp_path / "bin", tmp_path / f"{name}.json"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(STAND_IN.format(python=sys.executable, out=str(out)))
    script.chmod(0o755)
    return bin_dir, out


def launch(daemon: Daemon | None, bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = env_for(daemon, PATH=f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}")
    return subprocess.run([*CORRAL, "launch", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def given(out: Path) -> dict[str, Any]:
    return dict(json.loads(out.read_text()))


@pytest.mark.model
def test_each_agent_is_pointed_at_the_daemon(daemon: Daemon, tmp_path: Path) -> None:
    base = f"http://{daemon.address[0]}:{daemon.address[1]}"
    for name in ("claude", "codex", "opencode"):
        bin_dir, out = stand_in(tmp_path, name)
        ran = launch(daemon, bin_dir, name, "--model", AGENT, "--", "-p", "Say hi")
        assert ran.returncode == 7, ran.stderr  # the agent's own exit status
        seen = given(out)
        assert seen["argv"][-2:] == ["-p", "Say hi"]
        env = seen["env"]
        if name == "claude":
            assert env["ANTHROPIC_BASE_URL"] == base and seen["argv"][:2] == ["--model", AGENT]
            for tier in ("OPUS", "SONNET", "HAIKU"):
                assert env[f"ANTHROPIC_DEFAULT_{tier}_MODEL"] == AGENT
            assert env["CLAUDE_CODE_SUBAGENT_MODEL"] == AGENT
            # The loaded context is too short for Claude Code's first prompt, so it is
            # not told (it would refuse to send); the user is.
            assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in env
            assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "1024"
        elif name == "codex":
            flags = seen["argv"]
            assert f'model_providers.corral.base_url="{base}/v1"' in flags
            assert 'model_providers.corral.wire_api="responses"' in flags
            assert flags[flags.index("-m") + 1] == AGENT
        else:
            config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
            provider = config["provider"]["corral"]
            assert provider["options"]["baseURL"] == base + "/v1"
            assert config["model"] == f"corral/{AGENT}"
            assert "limit" not in provider["models"][AGENT]
        assert f"context (1024 tokens) is shorter than {TITLES[name]}'s" in ran.stderr
    assert not list((Path(os.environ["HOME"])).glob(".*"))  # no agent configuration written


TITLES = {"claude": "Claude Code", "codex": "Codex", "opencode": "OpenCode"}


def test_a_long_enough_window_is_passed_on() -> None:
    """A context an agent's prompts fit in is its window: Claude Code's (and, from 100k,
    its auto-compact window), Codex's model_context_window, OpenCode's model limit."""
    for context in (32768, 131072):
        t = agents.Target("http://127.0.0.1:1", "k", "m", context)
        claude = agents.AGENTS["claude"].build("claude", t, []).env
        assert claude["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(context)
        assert claude.get("CLAUDE_CODE_AUTO_COMPACT_WINDOW") == (
            str(context) if context >= 100_000 else None)
        codex = agents.AGENTS["codex"].build("codex", t, [])
        assert f"model_context_window={context}" in codex.argv and not codex.warning
        opencode = json.loads(agents.AGENTS["opencode"].build("opencode", t, []).env[
            "OPENCODE_CONFIG_CONTENT"])
        assert opencode["provider"]["corral"]["models"]["m"]["limit"]["context"] == context


@pytest.mark.model
def test_refusals(daemon: Daemon, tmp_path: Path) -> None:
    bin_dir, _ = stand_in(tmp_path, "claude")
    plain = launch(daemon, bin_dir, "claude", "--model", "smollm2:135m")
    assert plain.returncode == 1 and "does not declare tools" in plain.stderr
    unnamed = launch(daemon, bin_dir, "claude")
    assert unnamed.returncode == 1 and f"declare tools: {AGENT}" in unnamed.stderr
    missing = launch(daemon, tmp_path / "empty", "codex", "--model", AGENT)
    assert missing.returncode == 1
    assert missing.stderr.strip() == ("Error: Codex is not installed; install it with: "
                                      "npm install -g @openai/codex")
    unknown = launch(daemon, bin_dir, "aider", "--model", AGENT)
    assert unknown.returncode == 1 and "claude, codex, opencode" in unknown.stderr


def test_listing(tmp_path: Path) -> None:
    bin_dir, _ = stand_in(tmp_path, "opencode")
    listed = launch(None, bin_dir)
    assert listed.returncode == 0
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[2:]}
    assert set(rows) == {"claude", "codex", "opencode"}
    assert "installed (" in rows["opencode"] and "npm install -g opencode-ai" not in rows[
        "opencode"]
    assert rows["claude"].endswith("not installed: npm install -g @anthropic-ai/claude-code")


AGENTS = {"claude": "@anthropic-ai/claude-code@2.1.332", "codex": "@openai/codex@0.171.0",
          "opencode": "opencode-ai@1.18.33"}
ONE_LINE = {"claude": ["-p", "Say hi"],
            "codex": ["exec", "--skip-git-repo-check", "Say hi"],
            "opencode": ["run", "Say hi"]}


@pytest.mark.network
@pytest.mark.model
def test_real_agents_finish_a_one_line_task(daemon: Daemon, tmp_path: Path) -> None:
    """The three agents, from npm, each through `corral launch` in a fresh HOME."""
    npm = shutil.which("npm")
    assert npm is not None, "the network tests need Node.js and npm"
    prefix = tmp_path / "npm"
    subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                    *AGENTS.values()], check=True, capture_output=True, timeout=600)
    bin_dir = prefix / "node_modules" / ".bin"
    work = tmp_path / "work"
    work.mkdir()
    proxy = AgentProxy("{}:{}".format(*daemon.address))
    try:
        for name, args in ONE_LINE.items():
            env = env_for(None, HOME=str(tmp_path / f"home-{name}"),
                          PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                          CORRAL_HOST=proxy.url.removeprefix("http://"))
            Path(env["HOME"]).mkdir()
            before = len(proxy.exchanges)
            ran = subprocess.run([*CORRAL, "launch", name, "--model", AGENT, "--", *args],
                                 capture_output=True, text=True, env=env, cwd=work,
                                 stdin=subprocess.DEVNULL, timeout=600)
            assert ran.returncode == 0, (name, ran.stdout[-2000:], ran.stderr[-2000:])
            # Structure, not text: a tiny model's answer may be empty (Codex printed
            # nothing once, its 1,024 tokens spent), so the agent's model requests are
            # what is asserted: answered, none refused.
            mine = [(e.path, e.status) for e in proxy.exchanges[before:]]
            model_routes = ("/v1/messages", "/v1/responses", "/v1/chat")
            assert any(status == 200 and path.startswith(model_routes)
                       for path, status in mine), (name, mine)
            assert not proxy.refused(), [(e.method, e.path, e.status) for e in proxy.refused()]
    finally:
        proxy.close()
