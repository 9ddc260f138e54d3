"""`corral launch AGENT`: a coding agent run against the daemon, set up for that run only.

Each agent is told where the daemon is and which model to use through its environment
and command line, never through its own configuration files: the user's setup is left
as it was, and the next plain `claude` or `codex` talks to its usual provider again.

    claude    Anthropic's Messages API: ANTHROPIC_BASE_URL, every model tier (opus,
              sonnet, haiku, subagents) routed to the model, and the loaded context as
              its auto-compact window
    codex     OpenAI's Responses API: a `corral` model provider given with -c, and the
              loaded context as its model_context_window
    opencode  OpenAI's chat API through @ai-sdk/openai-compatible, in
              OPENCODE_CONFIG_CONTENT, with the loaded context as the model's limit
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from corral.api.client import Client
from corral.errors import CorralError
from corral.registry.names import parse_name

# What an agent may send as a key; the daemon checks it only where CORRAL_API_KEY is set.
NO_KEY = "corral"
# Tokens: an agent's first request is 10-15k. Told a window shorter than that, Claude Code
# refuses to send and OpenCode compacts in a loop; left untold, each sends its prompt and
# the daemon cuts it to fit (and logs it).
AGENT_MIN_CONTEXT = 16384
CLAUDE_MIN_COMPACT = 100_000  # the least auto-compact window Claude Code takes


@dataclass(frozen=True)
class Target:
    """What an agent is pointed at: the daemon, its key, the model and its context."""

    base: str  # the daemon's URL, no trailing slash
    key: str
    model: str
    context: int  # the loaded context window, in tokens (0: unknown)

    @property
    def told(self) -> bool:
        """Whether the agent is told the window (AGENT_MIN_CONTEXT says why not always)."""
        return self.context >= AGENT_MIN_CONTEXT

    def short(self, agent: str) -> str:
        """The warning for a window too short to tell the agent ("": none)."""
        if not self.context or self.told:
            return ""
        return (f"{self.model}'s context ({self.context} tokens) is shorter than {agent}'s "
                f"first request (10-15k tokens): the daemon cuts each prompt to fit, and its "
                "log says so; a model with a longer context (or PARAMETER num_ctx) reads it "
                "whole")


@dataclass(frozen=True)
class Launch:
    """How an agent is run: its command line and what its environment adds."""

    argv: list[str]
    env: dict[str, str]
    warning: str = ""  # said on stderr before the agent starts


@dataclass(frozen=True)
class Agent:
    name: str  # as `corral launch` takes it
    title: str
    binary: str
    package: str  # on npm
    extra_paths: tuple[str, ...]  # where its own installer puts it, under HOME
    build: Callable[[str, Target, list[str]], Launch]

    @property
    def install(self) -> str:
        return f"npm install -g {self.package}"

    def find(self) -> str | None:
        found = shutil.which(self.binary)
        if found:
            return found
        home = Path.home()
        for rel in self.extra_paths:
            if (home / rel / self.binary).is_file():
                return str(home / rel / self.binary)
        return None


def _claude(binary: str, t: Target, args: list[str]) -> Launch:
    env = {"ANTHROPIC_BASE_URL": t.base, "ANTHROPIC_API_KEY": "", "ANTHROPIC_AUTH_TOKEN": t.key,
           # Every tier and subagent on the one local model: Claude Code would otherwise
           # ask for a Claude model by name for its quick tasks.
           "ANTHROPIC_MODEL": t.model, "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model,
           "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,
           "ANTHROPIC_SMALL_FAST_MODEL": t.model, "CLAUDE_CODE_SUBAGENT_MODEL": t.model,
           # The attribution header and the token countdown change the prompt's start on
           # every turn, which would leave nothing for the prompt cache to reuse.
           "CLAUDE_CODE_ATTRIBUTION_HEADER": "0", "CLAUDE_CODE_TOTAL_TOKENS_REMINDER": "off",
           "DISABLE_ERROR_REPORTING": "1", "DISABLE_FEEDBACK_COMMAND": "1",
           "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1", "DISABLE_TELEMETRY": "1"}
    if t.context:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(min(32000, max(t.context // 4, 1024)))
    # It knows no local model's window, and would assume a million tokens.
    if t.told:
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(t.context)
    if t.context >= CLAUDE_MIN_COMPACT:
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(t.context)
    return Launch([binary, "--model", t.model, *args], env, t.short("Claude Code"))


def _codex(binary: str, t: Target, args: list[str]) -> Launch:
    provider = {"name": "Corral", "base_url": t.base + "/v1", "wire_api": "responses",
                "env_key": "CODEX_CORRAL_KEY"}
    config = ["model_provider=\"corral\"",
              *(f"model_providers.corral.{k}={json.dumps(v)}" for k, v in provider.items())]
    if t.told:
        config.append(f"model_context_window={t.context}")
    flags = [flag for c in config for flag in ("-c", c)]
    return Launch([binary, *flags, "-m", t.model, *args], {"CODEX_CORRAL_KEY": t.key},
                  t.short("Codex"))


def _opencode(binary: str, t: Target, args: list[str]) -> Launch:
    model: dict[str, object] = {"name": t.model, "tool_call": True}
    if t.told:
        model["limit"] = {"context": t.context, "output": min(32000, t.context // 4)}
    config = {"$schema": "https://opencode.ai/config.json", "model": f"corral/{t.model}",
              "provider": {"corral": {"npm": "@ai-sdk/openai-compatible", "name": "Corral",
                                      "options": {"baseURL": t.base + "/v1", "apiKey": t.key},
                                      "models": {t.model: model}}}}
    return Launch([binary, *args], {"OPENCODE_CONFIG_CONTENT": json.dumps(config)},
                  t.short("OpenCode"))


AGENTS = {a.name: a for a in (
    Agent("claude", "Claude Code", "claude", "@anthropic-ai/claude-code",
          (".local/bin", ".claude/local"), _claude),
    Agent("codex", "Codex", "codex", "@openai/codex", (), _codex),
    Agent("opencode", "OpenCode", "opencode", "opencode-ai", (".opencode/bin",), _opencode),
)}


def agent_named(name: str) -> Agent:
    if name not in AGENTS:
        raise CorralError(f"unknown agent {name!r}: corral launch takes "
                          f"{', '.join(AGENTS)}")
    return AGENTS[name]


def listing() -> str:
    """`corral launch` alone: each agent, whether it is installed, how to install it."""
    lines = ["Agents corral launch runs (corral launch AGENT --model MODEL [-- ARGS]):", ""]
    for a in AGENTS.values():
        where = a.find()
        state = f"installed ({where})" if where else f"not installed: {a.install}"
        lines.append(f"  {a.name:<10}{a.title:<13}{state}")
    return "\n".join(lines)


def target(c: Client, model: str, key: str | None) -> Target:
    """The model checked (there, and declaring tools: an agent calls them every turn),
    then loaded, so that the agent is told the context it really has."""
    if not model:
        usable = [m["name"] for m in c.tags() if "tools" in (m.get("capabilities") or [])]
        raise CorralError("corral launch needs --model: models here that declare tools: "
                          + (", ".join(usable) or "none (a template that renders tools "
                                                   "makes one: docs/agents.md)"))
    capabilities = c.show(model).get("capabilities") or []
    if "tools" not in capabilities:
        raise CorralError(f"{model} does not declare tools (its template renders none), and "
                          "an agent calls tools on every turn: docs/agents.md shows how to "
                          "give a model a template that does")
    c.load(model)
    shown = parse_name(model).display()  # as /api/ps names it
    context = next((int(m.get("context_length") or 0) for m in c.ps()
                    if m.get("name") == shown), 0)
    return Target(c.base.rstrip("/"), key or NO_KEY, model, context)
