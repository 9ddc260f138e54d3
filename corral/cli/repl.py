"""`corral run`: one answer for scripts, or the interactive chat REPL."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console

from corral.api.client import Client, ClientError
from corral.cli.images import attach
from corral.cli.runoptions import RunOptions
from corral.cli.tables import verbose_stats
from corral.config import state_dir
from corral.errors import CorralError, InvalidOption
from corral.options import coerce_option
from corral.private import open_private, private_dir

HELP = """Available Commands:
  /set            Set session variables
  /show           Show model information
  /load <model>   Load a session or model
  /save <model>   Save your current session
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command

Use \"\"\" to begin a multi-line message."""

SET_HELP = """Available Commands:
  /set parameter ...     Set a parameter
  /set system <string>   Set system message
  /set format json       Enable JSON mode
  /set noformat          Disable formatting
  /set verbose           Show LLM stats
  /set quiet             Disable LLM stats
  /set think [level]     Let a thinking model think (low, medium, high, max)
  /set nothink           Ask it not to think
  /set wordwrap          Enable wordwrap
  /set nowordwrap        Disable wordwrap"""

SHOW_HELP = """Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template"""


def _request(opts: RunOptions, **body: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": opts.model, **body}
    if opts.format:
        out["format"] = opts.format
    if opts.keep_alive is not None:
        out["keep_alive"] = opts.keep_alive
    if opts.think is not None:
        out["think"] = opts.think
    if opts.options:
        out["options"] = dict(opts.options)
    return out


def one_shot(client: Client, opts: RunOptions, prompt: str) -> None:
    """Stream one answer to stdout: plain text, no spinner or colour when piped.

    Thinking goes first, dimmed, on a terminal; piped, it is left out unless --think
    asked for it (and never with --hidethinking)."""
    if not prompt:
        for _ in client.stream("/api/generate", _request(opts)):
            pass
        return
    err = Console(stderr=True)
    prompt, images = attach(client, opts, prompt)
    stream = client.stream("/api/generate", _request(opts, prompt=prompt,
                                                     **({"images": images} if images else {})))
    tty = sys.stdout.isatty()
    show = not opts.hide_thinking and (tty or bool(opts.think))
    parts = ((obj.get("thinking", ""), obj.get("response", ""), obj) for obj in stream)
    final = _with_spinner(err, parts, opts.wordwrap and tty, show, dim=tty, spin=tty)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if opts.verbose:
        print(verbose_stats(final), file=sys.stderr)


class _Wrapper:
    """Word wrap at the terminal width minus 5, as pieces stream in."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.width = max(20, shutil.get_terminal_size((80, 24)).columns - 5)
        self.col = 0
        self.word = ""

    def feed(self, text: str) -> None:
        if not self.enabled:
            sys.stdout.write(text)
            return
        for ch in text:
            if ch in " \n":
                self._flush_word()
                if ch == "\n":
                    sys.stdout.write("\n")
                    self.col = 0
                elif self.col < self.width:
                    sys.stdout.write(" ")
                    self.col += 1
            else:
                self.word += ch
        sys.stdout.flush()

    def _flush_word(self) -> None:
        if not self.word:
            return
        if self.col + len(self.word) > self.width and self.col > 0:
            sys.stdout.write("\n")
            self.col = 0
        sys.stdout.write(self.word)
        self.col += len(self.word)
        self.word = ""

    def end(self) -> None:
        self._flush_word()
        sys.stdout.flush()


class _Thinking:
    """Thinking before the answer: a header, the text (dimmed on a terminal), a footer."""

    def __init__(self, show: bool, dim: bool) -> None:
        self.show, self.dim = show, dim
        self.open = False

    def feed(self, text: str) -> None:
        if not self.show or not text:
            return
        if not self.open:
            self._write("Thinking...\n")
            self.open = True
        self._write(text)

    def close(self) -> None:
        if self.open:
            self._write("\n...done thinking.\n\n")
            self.open = False

    def _write(self, text: str) -> None:
        sys.stdout.write(f"\x1b[2m{text}\x1b[0m" if self.dim else text)
        sys.stdout.flush()


def _with_spinner(err: Console, parts: Iterator[tuple[str, str, dict[str, Any]]],
                  wordwrap: bool, show_thinking: bool, dim: bool = True,
                  spin: bool = True) -> dict[str, Any]:
    """Print (thinking, text, object) parts as they stream; returns the final object."""
    wrap = _Wrapper(wordwrap)
    thinking = _Thinking(show_thinking, dim)
    final: dict[str, Any] = {}
    status = err.status("", spinner="dots")
    if spin:
        status.start()
    started = not spin
    try:
        for thought, text, obj in parts:
            if (text or (thought and show_thinking)) and not started:
                status.stop()
                started = True
            thinking.feed(thought)
            if text:
                thinking.close()
            wrap.feed(text)
            if obj.get("done"):
                final = obj
    finally:
        if not started:
            status.stop()
        thinking.close()
        wrap.end()
    return final


class Session:
    def __init__(self, client: Client, opts: RunOptions) -> None:
        self.client = client
        self.opts = opts
        self.messages: list[dict[str, Any]] = []
        self.err = Console(stderr=True)

    def chat(self, text: str) -> None:
        messages = list(self.messages)
        if self.opts.system:
            messages = [{"role": "system", "content": self.opts.system}] + messages
        text, images = attach(self.client, self.opts, text)
        turn: dict[str, Any] = {"role": "user", "content": text}
        if images:
            turn["images"] = images
        messages.append(turn)
        stream = self.client.stream("/api/chat", _request(self.opts, messages=messages))
        pieces: list[str] = []

        def collect() -> Iterator[tuple[str, str, dict[str, Any]]]:
            for obj in stream:
                message = obj.get("message", {})
                pieces.append(message.get("content", ""))
                yield message.get("thinking", ""), message.get("content", ""), obj
        try:
            final = _with_spinner(self.err, collect(), self.opts.wordwrap,
                                  not self.opts.hide_thinking)
        except KeyboardInterrupt:
            stream.close()
            self.client.hang_up()  # hanging up cancels the generation on the daemon
            print()
            return  # a cancelled answer is not added to the history
        print("\n")
        self.messages += [turn, {"role": "assistant", "content": "".join(pieces)}]
        if self.opts.verbose:
            print(verbose_stats(final), file=sys.stderr)

    # ---- slash commands ---------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run a slash command; False means exit."""
        words = line.split()
        cmd, args = words[0], words[1:]
        if cmd in ("/bye", "/exit"):
            return False
        if cmd in ("/?", "/help"):
            print({"set": SET_HELP, "show": SHOW_HELP}.get(args[0] if args else "", HELP))
        elif cmd == "/set":
            self._set(args, line)
        elif cmd == "/show":
            self._show(args[0] if args else "")
        elif cmd == "/clear":
            self.messages = []
            print("Cleared session context")
        elif cmd == "/load" and args:
            if not self.client.exists(args[0]):
                print(f"Couldn't find model '{args[0]}'")
            else:
                print(f"Loading model '{args[0]}'")
                self.opts.model, self.messages = args[0], []
        elif cmd == "/save" and args:
            body = {"model": args[0], "from": self.opts.model, "parameters": self.opts.options,
                    "messages": self.messages}
            if self.opts.system:
                body["system"] = self.opts.system
            for _ in self.client.stream("/api/create", body):
                pass
            print(f"Created new model '{args[0]}'")
        else:
            print(f"Unknown command '{cmd}'. Type /? for help")
        return True

    def _set(self, args: list[str], line: str) -> None:
        if not args:
            print(SET_HELP)
            return
        what = args[0]
        if what == "parameter" and len(args) >= 3:
            name, values = args[1], args[2:]
            try:
                value = coerce_option(name, values if name == "stop" else " ".join(values))
            except InvalidOption as exc:
                print(f'Couldn\'t set parameter: "{exc.message}"')
                return
            self.opts.options[name] = value
            print(f"Set parameter '{name}' to '{', '.join(values)}'")
        elif what == "system":
            text = line.split("system", 1)[1].strip().strip('"')
            self.opts.system = text
            print("Set system message.")
        elif what == "format" and args[1:] == ["json"]:
            self.opts.format = "json"
            print("Set format to 'json' mode.")
        elif what == "noformat":
            self.opts.format = None
            print("Disabled format.")
        elif what in ("verbose", "quiet"):
            self.opts.verbose = what == "verbose"
            print(f"Set '{what}' mode.")
        elif what in ("think", "nothink"):
            level = args[1].lower() if what == "think" and len(args) > 1 else None
            if level is not None and level not in ("low", "medium", "high", "max"):
                print("Invalid think level: use low, medium, high or max.")
                return
            self.opts.think = level or what == "think"
            print("Set 'think' mode." if what == "think" else "Set 'nothink' mode.")
        elif what in ("wordwrap", "nowordwrap"):
            self.opts.wordwrap = what == "wordwrap"
            print(f"Set '{what}' mode.")
        else:
            print(SET_HELP)

    def _show(self, what: str) -> None:
        from corral.cli.tables import show_text

        info = self.client.show(self.opts.model)
        empty = {"license": "No license was specified for this model.",
                 "system": "No system message was specified for this model.",
                 "template": "No prompt template was specified for this model."}
        if what == "info":
            print(show_text(info))
        elif what == "parameters":
            print("Model defined parameters:\n" + (info.get("parameters") or ""))
            if self.opts.options:
                print("\nUser defined parameters:")
                for k, v in self.opts.options.items():
                    print(f"{k:<30} {v}")
        elif what == "system" and self.opts.system:
            print(self.opts.system)
        elif what in ("license", "modelfile", "system", "template"):
            print(info.get(what) or empty.get(what, ""))
        else:
            print(SHOW_HELP)


def _read_message(first: str) -> str:
    """A line opening with \"\"\" continues until a line ending with \"\"\"."""
    body = first[3:]
    if body.endswith('"""') and len(first) > 3:
        return body[:-3]
    lines = [body]
    while True:
        line = input("... ")
        if line.endswith('"""'):
            lines.append(line[:-3])
            return "\n".join(lines).strip("\n")
        lines.append(line)


def _history(readline: Any) -> Path | None:
    """The history file, read into readline. What was typed is private: the file is 0600
    in a 0700 state folder from the start (readline's own write makes a 0600 file too,
    but only at exit, and says nothing when it replaces a looser one). None when the
    file cannot be made: the REPL then keeps no history."""
    try:
        path = private_dir(state_dir()) / "history"
        open_private(path, append=True).close()
    except OSError:
        return None
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(100)
    return path


def interactive(client: Client, opts: RunOptions) -> None:
    session = Session(client, opts)
    try:
        import readline
    except ImportError:  # pragma: no cover - Windows without pyreadline
        readline = None  # type: ignore[assignment]
    history = _history(readline) if readline is not None and opts.history else None
    with session.err.status("", spinner="dots"):
        for _ in client.stream("/api/generate", _request(opts)):
            pass
    try:
        while True:
            try:
                line = input(">>> ")
            except KeyboardInterrupt:
                print("\nUse Ctrl + d or /bye to exit.")
                continue
            except EOFError:
                print()
                return
            if not line.strip():
                continue
            try:
                if line.startswith('"""'):
                    line = _read_message(line)
                elif line.startswith("/"):
                    if not session.command(line):
                        return
                    continue
                session.chat(line)
            except KeyboardInterrupt:
                client.hang_up()  # whatever the command had open ends with it
                print()
            except (ClientError, CorralError) as exc:
                print(f"Error: {exc.message}", file=sys.stderr)
    finally:
        if history is not None:
            try:
                readline.write_history_file(history)
            except OSError:
                pass


