"""Test helpers: the real daemon in-process on port 0, and waiting for a condition."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from corral.config import load_settings
from corral.registry.store import Store
from corral.runner.loadconfig import LoadConfig
from corral.runner.speculative.cost import StepCost
from corral.server.daemon import Daemon
from corral.server.residency.resident import Runner


def start_daemon(store: Store | None, tmp: Path, capacity: int | None = None,
                 runner_factory: Callable[[LoadConfig], Runner] | None = None,
                 **env: str) -> Daemon:
    """A daemon over a view of `store` (manifests copied, blobs linked), or an empty store;
    `capacity` bytes at most in its blobs (a full disk, without mounting one)."""
    root = tmp / "models"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    if store is not None:
        for blob in store.blobs.iterdir():
            target = root / "blobs" / blob.name
            if not target.exists():
                target.hardlink_to(blob)
        if store.manifests.exists():
            shutil.copytree(store.manifests, root / "manifests", dirs_exist_ok=True)
    settings = load_settings({"CORRAL_HOST": "127.0.0.1:0", "CORRAL_MODELS": str(root),
                              "CORRAL_NUM_PARALLEL": "2", "CORRAL_CONTEXT_LENGTH": "1024",
                              **{f"CORRAL_{k}": v for k, v in env.items()}})
    return Daemon(settings, runner_factory, store=Store(root, capacity)).start()


DaemonFactory = Callable[..., Daemon]  # (store, root=None, **CORRAL_settings) -> started daemon


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.02) -> None:
    """Poll until `predicate()` is true; fail the test when `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(interval)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30.0) -> None:
    """Wait until something accepts connections on loopback `port`."""
    import socket

    def accepts() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False

    wait_for(accepts, timeout, 0.1)


def embed(engine: Any, inputs: list[list[int]], truncate: bool = True) -> list[list[float]]:
    """Embed on an engine and wait, as the runner process does for /embed."""
    from corral.runner.jobs import Embed

    return list(engine.run_embed(Embed(inputs, truncate)))


# The real runner process with a step hook that does `action` at the 4th step of the
# first runner only: the marker file goes with it, so the runner loaded after it works.
STAND_IN = '''#!{python}
import sys
import threading
from pathlib import Path

from corral.runner.llama import capi
capi.install()
from corral.runner.process.loading import Pending
from corral.runner.process.main import main

marker, steps = Path({marker!r}), []

def hook(plan):
    steps.append(plan)
    if len(steps) == 4 and marker.exists():
        marker.unlink()
        {action}

sys.exit(main(pending=Pending(sys.argv[3:]), step_hook=hook))
'''


STUCK_NATIVE = '''#!{python}
import sys
import threading
from pathlib import Path

from corral.runner.llama import capi
capi.install()
import {module} as native
from corral.runner.process.loading import Pending
from corral.runner.process.main import main

marker, real = Path({marker!r}), native.{function}

def stuck(*args):
    if marker.exists():  # armed by the test: this call never returns, as a stopped
        marker.unlink()  # RPC worker's or a hung device's does not
        threading.Event().wait()
    return real(*args)

native.{function} = stuck
sys.exit(main(pending=Pending(sys.argv[3:])))
'''


def stuck_native_runner(tmp_path: Path, module: str, function: str) -> tuple[Path, Path]:
    """A runner whose llama.cpp binding `module.function` (llama-cpp-python's, not ours)
    never returns once the test creates the marker; (its script, the marker to arm)."""
    import sys

    marker = tmp_path / "armed"
    script = tmp_path / "stuck-runner"
    script.write_text(STUCK_NATIVE.format(python=sys.executable, marker=str(marker),
                                          module=module, function=function))
    script.chmod(0o755)
    return script, marker


def stand_in_runner(tmp_path: Path, action: str) -> tuple[Path, Path]:
    """The stand-in runner's script and its marker, armed: the first runner's 4th step
    runs `action` (one line of Python: raise, or block)."""
    import sys

    marker = tmp_path / "once"
    marker.touch()
    script = tmp_path / "runner"
    script.write_text(STAND_IN.format(python=sys.executable, marker=str(marker),
                                      action=action))
    script.chmod(0o755)
    return script, marker


def llama_greedy(model: Any, prompt: list[int], n: int, stop: Callable[[int], bool] | None = None
                 ) -> list[int]:
    """The greedy answer as llama.cpp's own loop gives it (what llama-server's slot does):
    one context of one sequence, the prompt in one batch, then a token at a time, up to
    `n`, or before the first token `stop` names."""
    import llama_cpp as L

    params = L.llama_context_default_params()
    params.n_ctx, params.n_batch = 1024, 512
    ctx = L.llama_init_from_model(model, params)
    sampler = L.llama_sampler_init_greedy()
    out: list[int] = []
    try:
        batch = prompt
        for _ in range(n):
            arr = (L.llama_token * len(batch))(*batch)
            assert L.llama_decode(ctx, L.llama_batch_get_one(arr, len(batch))) == 0
            token = L.llama_sampler_sample(sampler, ctx, -1)
            if stop is not None and stop(token):
                break
            out.append(token)
            batch = [token]
    finally:
        L.llama_sampler_free(sampler)
        L.llama_free(ctx)
    return out


def greedy(engine: Any, prompt: list[int], **job: Any) -> tuple[list[Any], Any]:
    """A greedy, seeded job on an engine with two logprobs a token, to its end."""
    from corral.runner.jobs import Job, SamplingParams

    return collect(engine.submit(Job(prompt=prompt, params=SamplingParams(temperature=0, seed=1),
                                     logprobs=2, ignore_eos=True, **job)))


def started(engines: dict[Any, Any]) -> Iterator[dict[Any, Any]]:
    """A fixture's engines, started, yielded, and stopped after (`yield from`)."""
    for e in engines.values():
        e.start()
    yield engines
    for e in engines.values():
        e.stop()


def llama_cpp_greedy(gguf: Path, prompt: list[int], n: int) -> list[int]:
    """`llama_greedy` on the model in `gguf`, loaded for it alone."""
    import llama_cpp as L

    model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
    try:
        return llama_greedy(model, prompt, n)
    finally:
        L.llama_model_free(model)


def same_output(a: tuple[list[Any], Any], b: tuple[list[Any], Any]) -> None:
    """Two runs' (tokens, Done) are one output: text, logprobs (a step's kept drafts come
    as one event: the same tokens' logprobs, grouped by step), end and counts."""
    assert "".join(t.text for t in a[0]) == "".join(t.text for t in b[0])
    assert [lp for t in a[0] for lp in t.logprobs] == [lp for t in b[0] for lp in t.logprobs]
    assert a[1].stats.done_reason == b[1].stats.done_reason
    assert a[1].stats.eval_count == b[1].stats.eval_count
    assert a[1].stats.context == b[1].stats.context


def collect(job: Any, timeout: float = 300) -> tuple[list[Any], Any]:
    """A submitted job's Token events and its Done (each waited for at most `timeout`)."""
    from corral.runner.jobs import Done, Token

    tokens = []
    while isinstance(event := job.events.get(timeout=timeout), Token):
        tokens.append(event)
    assert isinstance(event, Done), event
    return tokens, event


class FlatCost(StepCost):
    """Every decode step priced alike whatever its rows (a GPU's curve, nearly): what an
    engine given it drafts follows the tokens only, not how fast this machine ran each
    step (a loaded CI machine's slow steps once priced a seeded test's drafts out: 8
    drafted, none kept)."""

    def observe(self, rows: int, seconds: float, passes: int = 1) -> None:
        super().observe(rows, 0.1, passes)
