"""The CLI as a user runs it, against a real daemon with the starter model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pexpect

from corral.registry.store import Store
from corral.server.daemon import Daemon
from tests.support import wait_for

MODEL = "gemma3:270m-base"  # completion
CHAT = "smollm2:135m"  # the chat starter
CORRAL = [sys.executable, "-c", "from corral.cli.launch import main; main()"]


def env_for(daemon: Daemon | None, **extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    if daemon is not None:
        host, port = daemon.address
        env["CORRAL_HOST"] = f"{host}:{port}"
    env.pop("NO_COLOR", None)
    return env


def corral(daemon: Daemon | None, *args: str, stdin: str | None = None,
           **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CORRAL, *args], capture_output=True, text=True, input=stdin,
                          env=env_for(daemon, **extra), timeout=180)


def test_list_and_ps_tables(daemon: Daemon) -> None:
    out = corral(daemon, "list")
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    assert any(r.startswith(MODEL + "    ") and "253 MB" in r for r in rows)
    assert "\x1b[" not in out.stdout
    names = [line.split()[0] for line in corral(daemon, "ls", "gemma").stdout.splitlines()]
    assert names == ["NAME", MODEL]
    corral(daemon, "run", MODEL, "Hi")
    ps = corral(daemon, "ps").stdout.splitlines()
    assert ps[0].split() == ["NAME", "ID", "SIZE", "CAP", "PROCESSOR", "CONTEXT", "UNTIL"]
    assert MODEL in ps[1] and "100% CPU" in ps[1] and "1024" in ps[1] and "from now" in ps[1]


def test_show_variants(daemon: Daemon) -> None:
    full = corral(daemon, "show", MODEL)
    assert full.returncode == 0 and "architecture        gemma3" in full.stdout
    assert "Capabilities" in full.stdout
    assert corral(daemon, "show", MODEL, "--modelfile").stdout.lstrip().startswith("# Modelfile")
    assert "User:" in corral(daemon, "show", MODEL, "--parameters").stdout
    assert ".Messages" in corral(daemon, "show", MODEL, "--template").stdout
    assert "Gemma" in corral(daemon, "show", MODEL, "--license").stdout
    verbose = corral(daemon, "show", MODEL, "-v")
    assert verbose.returncode == 0, verbose.stderr
    sections = verbose.stdout.split("\n\n")
    [metadata] = [s for s in sections if s.startswith("  Metadata")]
    [tokens] = [line for line in metadata.splitlines() if "tokenizer.ggml.tokens" in line]
    assert tokens.rstrip().endswith("items)") and len(tokens) < 200  # summarised, not dumped
    [tensors] = [s for s in sections if s.startswith("  Tensors")]
    assert any(line.split()[0] == "token_embd.weight" for line in tensors.splitlines()[1:])
    both = corral(daemon, "show", MODEL, "--license", "--system")
    assert both.returncode == 1 and both.stderr.startswith("Error: only one of")


def test_cp_rm_stop_create(daemon: Daemon, tmp_path: Path) -> None:
    assert corral(daemon, "cp", MODEL, "copy1").stdout.strip() == f"copied '{MODEL}' to 'copy1'"
    out = corral(daemon, "rm", "copy1")
    assert out.returncode == 0 and out.stdout.strip() == "deleted 'copy1'"
    gone = corral(daemon, "rm", "copy1")
    assert gone.returncode == 1 and gone.stderr.startswith("Error: model 'copy1' not found")
    assert corral(daemon, "stop", MODEL).returncode == 0
    missing = corral(daemon, "stop", "nope")
    assert missing.returncode == 1 and 'couldn\'t find model "nope" to stop' in missing.stderr
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM {MODEL}\nSYSTEM You are terse.\nPARAMETER temperature 0.1\n")
    made = corral(daemon, "create", "terse", "-f", str(modelfile))
    assert made.returncode == 0 and "success" in made.stderr
    assert "You are terse." in corral(daemon, "show", "terse", "--system").stdout
    nofile = subprocess.run([*CORRAL, "create", "x"], capture_output=True, text=True,
                            env=env_for(daemon), cwd=tmp_path / "..", timeout=60)
    assert nofile.returncode == 1 and "Modelfile wasn't found" in nofile.stderr


def test_errors_are_clean(daemon: Daemon) -> None:
    out = corral(daemon, "show", "nope")
    assert out.returncode == 1 and out.stderr == "Error: model 'nope:latest' not found\n"
    bad = corral(daemon, "run", "../x", "hi")
    assert bad.returncode == 1 and bad.stderr.startswith("Error: ") and "Traceback" not in bad.stderr


def test_one_shot_and_piped_output_is_clean(daemon: Daemon) -> None:
    """stdout is exactly the model's answer: compared with the API's, never with a guess."""
    httpx.post(daemon.url + "/api/create", timeout=60, json={
        "model": "greedy-chat", "from": CHAT, "stream": False,
        "parameters": {"temperature": 0, "seed": 7, "num_predict": 24}})

    def api_answer(prompt: str) -> str:
        r = httpx.post(daemon.url + "/api/generate", timeout=120, json={
            "model": "greedy-chat", "prompt": prompt, "stream": False})
        return str(r.json()["response"])

    one = corral(daemon, "run", "greedy-chat", "Say hi.")
    assert one.returncode == 0, one.stderr
    assert one.stdout == api_answer("Say hi.") + "\n"
    piped = corral(daemon, "run", "greedy-chat", "Summarize:", stdin="Cats sleep a lot.\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == api_answer("Summarize:\n\nCats sleep a lot.") + "\n"
    verbose = corral(daemon, "run", "greedy-chat", "Hi", "--verbose")
    assert "eval rate:" in verbose.stderr and "\x1b" not in verbose.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_auto_start(starter_store: Store, tmp_path: Path) -> None:
    state = tmp_path / "state"
    port = free_port()
    env = {"CORRAL_HOST": f"127.0.0.1:{port}", "CORRAL_MODELS": str(starter_store.root),
           "XDG_STATE_HOME": str(state), "CORRAL_NOPRUNE": "1"}
    out = corral(None, "list", **env)
    pid_file = state / "corral" / "server.pid"
    try:
        assert out.returncode == 0, out.stderr
        assert "Started corral server in the background" in out.stderr
        assert MODEL in out.stdout and (state / "corral" / "server.log").exists()
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
        again = corral(None, "list", **env)
        assert "Started" not in again.stderr  # already running
    finally:
        stop_background_daemon(pid_file)


def test_run_starts_the_daemon_and_preloads_the_model(starter_store: Store,
                                                      tmp_path: Path) -> None:
    state = tmp_path / "state"
    port = free_port()
    env = {"CORRAL_HOST": f"127.0.0.1:{port}", "CORRAL_MODELS": str(starter_store.root),
           "XDG_STATE_HOME": str(state), "CORRAL_NOPRUNE": "1"}
    # The base starter: its num_predict cap ends the answer whatever it samples.
    out = corral(None, "run", MODEL, "hi", "--verbose", **env)
    pid_file = state / "corral" / "server.pid"
    try:
        assert out.returncode == 0, out.stderr
        assert "Started corral server in the background" in out.stderr
        assert "eval rate:" in out.stderr
        log = (state / "corral" / "server.log").read_text()
        assert "loaded gemma3:270m-base" in log
        [loaded] = httpx.get(f"http://127.0.0.1:{port}/api/ps").json()["models"]
        assert loaded["name"] == MODEL
        # The daemon ran as `python -m corral.server` in the state directory, not the CLI's cwd.
        assert Path(f"/proc/{pid_file.read_text().strip()}/cwd").resolve() == state / "corral"
    finally:
        stop_background_daemon(pid_file)


def stop_background_daemon(pid_file: Path) -> None:
    """SIGTERM the daemon a CLI started, and wait until it has exited (with its runners)."""
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not _running(pid), timeout=60)


def _running(pid: int) -> bool:
    try:  # not our child: init reaps it, and a zombie has exited already
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False


def test_pull_progress(daemon: Daemon, starter_gguf: Path) -> None:
    from corral.registry import manifest as mt
    from tests.registry_server import FakeRegistry

    reg = FakeRegistry()
    try:
        reg.add_model("library", "starter", "v1", [(mt.MODEL, starter_gguf),
                                                   (mt.TEMPLATE, b"{{ .Prompt }}")])
        name = f"{reg.host}/library/starter:v1"
        plain = corral(daemon, "pull", name, "--insecure")
        assert plain.returncode == 0, plain.stderr
        lines = plain.stderr.splitlines()
        assert lines[0] == "pulling manifest" and lines[-1] == "success"
        assert any(line.endswith(": 100%") for line in lines)
        tty = pexpect.spawn(CORRAL[0], [*CORRAL[1:], "pull", name, "--insecure"],
                            env=env_for(daemon), encoding="utf-8", timeout=120,
                            dimensions=(40, 120))
        tty.expect("success")
        tty.expect(pexpect.EOF)
        tty.close()
        assert tty.exitstatus == 0
        missing = corral(daemon, "pull", f"{reg.host}/library/none", "--insecure")
        assert missing.returncode == 1 and "file does not exist" in missing.stderr
    finally:
        reg.close()


def visible(text: str) -> str:
    """Terminal text without escape sequences or spinner frames."""
    import re

    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    return re.sub(r"[\u2800-\u28ff\r]", "", text).strip()


def test_repl(daemon: Daemon, tmp_path: Path) -> None:
    httpx.post(daemon.url + "/api/create", timeout=60, json={
        "model": "rambler", "from": MODEL, "parameters": {"stop": [], "num_predict": -1},
        "stream": False})
    child = pexpect.spawn(CORRAL[0], [*CORRAL[1:], "run", CHAT],
                          env=env_for(daemon, XDG_STATE_HOME=str(tmp_path)),
                          encoding="utf-8", timeout=120, dimensions=(40, 100))
    child.expect(">>> ")
    child.sendline("/set parameter num_predict 48")  # a sampled answer may never end on its own
    child.expect(">>> ")
    child.sendline("Hello there")
    child.expect(">>> ")  # a streamed answer, then the prompt again
    child.sendline('"""Line one')
    child.expect(r"\.\.\. ")
    child.sendline('line two"""')
    child.expect(">>> ")
    child.sendline("/set parameter temperature 0")
    child.expect("Set parameter 'temperature' to '0'")
    child.expect(">>> ")
    answers = []
    for _ in range(2):
        child.sendline("/clear")
        child.expect("Cleared session context")
        child.expect(">>> ")
        child.sendline("What is the capital of France?")
        child.expect(">>> ")
        answers.append(visible(child.before.split("France?", 1)[-1]))
    assert answers[0] == answers[1]  # greedy: the same answer from the same context
    child.sendline("/set system You are a pirate.")
    child.expect("Set system message.")
    child.expect(">>> ")
    child.sendline("/show modelfile")
    child.expect("FROM ")
    child.expect(">>> ")
    child.sendline("/load rambler")
    child.expect("Loading model 'rambler'")
    child.expect(">>> ")
    child.sendline("Count from one to one thousand:")
    child.expect(r"\w+ \w+ \w+")  # some streamed words: it is streaming (for long)
    child.sendintr()
    child.expect(">>> ", timeout=30)
    child.sendline("/set parameter num_predict 3")
    # Its own reply first: a prompt the interrupted stream still printed is not this one,
    # and the next expect must not take it for the answer to "Hi".
    child.expect("Set parameter 'num_predict' to '3'")
    child.expect(">>> ")
    child.sendline("Hi")
    child.expect(">>> ")
    child.sendintr()
    child.expect("Use Ctrl \\+ d or /bye to exit.")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert (tmp_path / "corral" / "history").exists()


def test_pull_ctrl_c_then_resume(daemon: Daemon, starter_gguf: Path) -> None:
    from corral.registry import manifest as mt
    from tests.registry_server import FakeRegistry

    reg = FakeRegistry()
    try:
        payload = os.urandom(64 << 20)  # a blob the daemon's store does not have yet
        reg.add_model("library", "slow", "v1", [(mt.MODEL, payload)])
        digest = json_digest(reg)
        size = len(payload)
        reg.faults.hold_after = size // 4  # the registry stops sending there, until resumed
        name = f"{reg.host}/library/slow:v1"
        proc = subprocess.Popen([*CORRAL, "pull", name, "--insecure"], env=env_for(daemon),
                                stderr=subprocess.PIPE, text=True)
        wait_for(lambda: reg.stats.blob_bytes >= size // 4 or proc.poll() is not None, 60)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
        # The daemon notices the hang-up and cancels the download; let the held parts
        # go, and they see it and stop, leaving the partial file.
        downloads = daemon.downloader.active
        wait_for(lambda: digest not in downloads or downloads[digest].cancelled.is_set())
        reg.faults.hold_after = 0
        reg.faults.resume.set()
        wait_for(lambda: digest not in downloads)
        blob = daemon.store.blob_path(digest)
        partial = blob.with_name(blob.name + "-partial")
        assert partial.exists() and not daemon.store.has_blob(digest)
        served = reg.stats.blob_bytes
        again = corral(daemon, "pull", name, "--insecure")
        assert again.returncode == 0 and again.stderr.splitlines()[-1] == "success"
        assert reg.stats.blob_bytes - served < size * 0.9  # resumed, not restarted
        assert daemon.store.has_blob(digest) and not partial.exists()
    finally:
        reg.close()


def json_digest(reg: object) -> str:
    import json

    raw = reg.manifests[("library", "slow", "v1")]  # type: ignore[attr-defined]
    return str(json.loads(raw)["layers"][0]["digest"])
