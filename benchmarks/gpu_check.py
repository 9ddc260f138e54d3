"""The checks of benchmarks/gpu_check.sh: one JSON file and one markdown table under --out.

0. The model is made here: a random llama GGUF in F16 (benchmarks/gpu_model.py), uploaded
   to the daemon and quantized to Q4_K_M by Corral's create (llama_model_quantize).
1. Full offload: 32 greedy tokens equal a CPU run of the same file (num_gpu 0), and `ps`
   says 100% GPU. Tolerance: where the token ids first differ, the CPU's two best
   candidates must be within TIE nats; the kernels add in another order, which can flip
   a near tie, and after a flip the texts part, so later tokens are not compared.
2. Half offload (num_gpu = half the layers): `ps`'s split and estimate beside what
   nvidia-smi saw the load take.
3. c = 1, 4, 16, 64: Corral's default mode against llama-server from the same sources
   (`-np 64 --kv-unified`, the tuned peer), `corral bench` for both, in one run.
4. The auto slot cap measured: Corral with CORRAL_MAX_SLOTS raised, at c = 32..256; the
   cap is where doubling the clients last added 10% or more to aggregate tok/s.
5. Elastic KV on the GPU: slots and size at idle, at their largest under load (with
   nvidia-smi's), and after SHRINK_AFTER of quiet.

With --cpu every step runs on the CPU with the tiny model (the rehearsal in the test
suite); the GPU-only readings are recorded as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_model import SIZES, write_model  # noqa: E402
from gpu_report import table  # noqa: E402

NAME = "gpu-check:q4_K_M"
TIE = 0.1  # nats between the CPU's two best tokens that count as a near tie
RAW = {"temperature": 0, "seed": 1, "num_predict": 32, "ignore_eos": True}
PROMPT = "The quick brown fox"


class Run:
    """The settings of one run, and its result, written out after every step."""

    def __init__(self, args: argparse.Namespace) -> None:
        # The models and the benchmarks' raw files stay in `work`: the device tool brings
        # back at most 8 files from $OUT, so only the results and the logs go there.
        self.cpu, self.out, self.work = args.cpu, args.out, args.work or args.out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.size = "tiny" if args.cpu else "1b"
        self.levels = [1, 4] if args.cpu else [1, 4, 16, 64]
        self.knee = [2, 4, 8] if args.cpu else [32, 64, 128, 256]
        self.bin, self.tokenizer = args.bin, args.tokenizer
        import importlib.util
        spec = importlib.util.find_spec("llama_cpp")  # what the daemon and runners import too
        self.result: dict[str, Any] = {"mode": "cpu rehearsal" if args.cpu else "cuda",
                                       "build_seconds": args.build_seconds, "gpu": gpu_name(),
                                       "bindings": spec.origin if spec else None,
                                       "libraries": os.environ.get("LLAMA_CPP_LIB_PATH"),
                                       "checks": {}}

    def step(self, key: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        started = time.perf_counter()
        print(f"==> {key}", flush=True)
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - record it, go on to the next check
            value = {"error": f"{type(exc).__name__}: {exc}"}
        value["seconds"] = round(time.perf_counter() - started, 1)
        self.result["checks"][key] = value
        self.save()
        return value

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=2))
        (self.out / "gpu_check.md").write_text(table(self.result))


def gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip() or None


def gpu_used() -> int | None:
    """Bytes in use on the device, by nvidia-smi; None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                          "nounits"], capture_output=True, text=True, check=True)
    return sum(int(x) for x in out.stdout.split()) << 20


def gpu_processes() -> dict[int, int] | None:
    """Bytes each process holds on the device, by nvidia-smi; None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    rows = [line.split(",") for line in out.stdout.splitlines() if "," in line]
    return {int(pid): int(mb) << 20 for pid, mb in rows}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    """`python -m corral.server` on a free port, with its own environment."""

    def __init__(self, run: Run, tag: str, **env: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        full = dict(os.environ, CORRAL_HOST=f"127.0.0.1:{port}",
                    CORRAL_MODELS=str(run.work / "models"), CORRAL_NOPRUNE="1",
                    CORRAL_KEEP_ALIVE="-1", XDG_STATE_HOME=str(run.work / "state"),
                    **{f"CORRAL_{k}": v for k, v in env.items()})
        self.log = open(run.out / f"daemon-{tag}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "corral.server"], env=full,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_http(self.url + "/", self.proc)

    def ps(self) -> dict[str, Any]:
        models = httpx.get(self.url + "/api/ps", timeout=30).json()["models"]
        return next((m for m in models if m["name"] == NAME), {})

    def unload(self) -> None:
        httpx.post(self.url + "/api/generate", json={"model": NAME, "keep_alive": 0}, timeout=120)
        wait_for(lambda: not self.ps(), 60)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout:.0f} s")


def wait_for(predicate: Callable[[], Any], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def make_model(run: Run, tokenizer: Path, daemon: Daemon) -> dict[str, Any]:
    from corral.registry.store import file_sha256
    f16 = run.work / "random-f16.gguf"
    t0 = time.perf_counter()
    params = write_model(tokenizer, f16, SIZES[run.size])
    written = time.perf_counter() - t0
    digest = file_sha256(f16)
    with f16.open("rb") as f:
        httpx.post(f"{daemon.url}/api/blobs/{digest}", content=f, timeout=600).raise_for_status()
    t1 = time.perf_counter()
    r = httpx.post(daemon.url + "/api/create", timeout=1800, json={
        "model": NAME, "files": {f16.name: digest}, "quantize": "q4_K_M", "stream": False})
    r.raise_for_status()
    f16.unlink()
    return {"parameters": params, "size": run.size, "write_seconds": round(written, 1),
            "quantize_seconds": round(time.perf_counter() - t1, 1), "path": str(model_path(run))}


def model_path(run: Run) -> Path:
    from corral.registry.starter import starter_model_path
    from corral.registry.store import Store
    path = starter_model_path(Store(run.work / "models"), NAME)
    assert path is not None
    return path


def greedy(daemon: Daemon, **options: Any) -> list[dict[str, Any]]:
    r = httpx.post(daemon.url + "/api/generate", timeout=600, json={
        "model": NAME, "prompt": PROMPT, "raw": True, "stream": False, "logprobs": True,
        "top_logprobs": 2, "options": {**RAW, **options}})
    r.raise_for_status()
    return list(r.json()["logprobs"])


def full_offload(run: Run, daemon: Daemon) -> dict[str, Any]:
    ours = greedy(daemon)  # all layers on the GPU (the CPU, in the rehearsal)
    ps, holders = daemon.ps(), gpu_processes()
    daemon.unload()
    cpu = greedy(daemon, num_gpu=0)
    daemon.unload()
    first = next((i for i, (a, b) in enumerate(zip(ours, cpu)) if a["token"] != b["token"]),
                 None)
    margin = None
    if first is not None:
        top = cpu[first]["top_logprobs"]
        margin = top[0]["logprob"] - top[1]["logprob"] if len(top) > 1 else None
    return {"tokens": len(cpu), "equal": first is None and len(ours) == len(cpu),
            "first_difference": first, "cpu_margin_there": margin,
            "within_tolerance": first is None or (margin is not None and margin < TIE),
            "text": "".join(t["token"] for t in ours), "cpu_text": "".join(t["token"] for t in cpu),
            "size": ps.get("size"), "size_vram": ps.get("size_vram"),
            "all_on_gpu": (ps.get("size_vram") == ps.get("size")) if not run.cpu else None,
            # The daemon asks NVML, not CUDA, for free memory: it should hold none itself.
            "daemon_vram": None if holders is None else holders.get(daemon.proc.pid, 0),
            "gpu_processes": holders,
            "skipped": "no GPU: both runs are CPU runs" if run.cpu else None}


def half_offload(run: Run, daemon: Daemon) -> dict[str, Any]:
    layers = SIZES[run.size].n_layer // 2
    before = gpu_used()
    greedy(daemon, num_gpu=layers, num_predict=4)
    after = gpu_used()
    ps = daemon.ps()
    daemon.unload()
    used = after - before if after is not None and before is not None else None
    size, vram = int(ps.get("size", 0)), int(ps.get("size_vram", 0))
    return {"num_gpu": layers, "size": size, "estimate_vram": vram,
            "split_gpu": round(vram / size, 3) if size else None, "nvidia_smi_vram": used,
            "estimate_error": round(vram / used - 1, 3) if used else None,
            "skipped": "no GPU: nvidia-smi absent, everything on the CPU" if run.cpu else None}


def bench(url: str, model: str, levels: list[int], out: Path,
          per_client: int = 4) -> list[dict[str, Any]]:
    """`corral bench` over /v1 (what both servers speak), prompts of 32 tokens, 64 out."""
    subprocess.run([sys.executable, "-m", "corral.cli", "bench", model, "--api", "openai",
                    "--base-url", url, "--concurrency", ",".join(map(str, levels)),
                    "--per-client", str(per_client),
                    "--max-tokens", "64", "--prompt-tokens", "32", "--seed", "1",
                    "--json", str(out)], check=True, timeout=1800, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return [{"c": c, "tok_s": round(lv["output_throughput"], 1), "failed": lv["failed"],
             "ttft_p50_ms": round(lv["ttft"]["median"] * 1000)}
            for c, lv in zip(levels, json.loads(out.read_text())["levels"])]


class Poller(threading.Thread):
    """ps and nvidia-smi twice a second while a load runs: the largest slots and sizes."""

    def __init__(self, daemon: Daemon) -> None:
        super().__init__(daemon=True)
        self.d, self.stop_event = daemon, threading.Event()
        self.slots = self.size = self.vram = 0

    def run(self) -> None:
        while not self.stop_event.wait(0.5):
            try:
                ps = self.d.ps()
            except httpx.HTTPError:
                continue
            self.slots = max(self.slots, int(ps.get("slots", 0)))
            self.size = max(self.size, int(ps.get("size", 0)))
            self.vram = max(self.vram, gpu_used() or 0)


def corral_levels(run: Run, daemon: Daemon) -> dict[str, Any]:
    """Check 3's Corral side, with check 5's readings taken around it."""
    greedy(daemon, num_predict=1)  # loaded, then left idle: one slot
    time.sleep(1)
    idle, idle_vram = daemon.ps(), gpu_used()
    poller = Poller(daemon)
    poller.start()
    levels = bench(daemon.url, NAME, run.levels, run.work / "corral.json")
    poller.stop_event.set()
    poller.join()
    from corral.runner.kv.growth import SHRINK_AFTER
    t0 = time.monotonic()
    shrank = wait_for(lambda: daemon.ps().get("slots", 0) < poller.slots, SHRINK_AFTER + 20)
    after = daemon.ps()
    growth = {"idle": {"slots": idle.get("slots"), "size": idle.get("size"),
                       "nvidia_smi": idle_vram},
              "busiest": {"slots": poller.slots, "size": poller.size,
                          "nvidia_smi": poller.vram or None},
              "after_quiet": {"slots": after.get("slots"), "size": after.get("size"),
                              "nvidia_smi": gpu_used(),
                              "seconds": round(time.monotonic() - t0, 1) if shrank else None},
              "slots_cap": idle.get("slots_cap"),
              "grew": poller.slots > int(idle.get("slots") or 0), "shrank": shrank}
    return {"levels": levels, "growth": growth}


def llama_server(run: Run) -> dict[str, Any]:
    exe = run.bin / "llama-server" if run.bin else None
    if exe is None or not exe.exists():
        return {"skipped": "no llama-server here (benchmarks/build_llama_server.sh builds one)"}
    port = free_port()
    slots = max(run.levels)
    cmd = [str(exe), "-m", str(model_path(run)), "--port", str(port), "-np", str(slots),
           "--kv-unified", "-c", str(slots * 1024), "-ngl", "0" if run.cpu else "999"]
    log = open(run.out / "llama-server.log", "wb")
    env = dict(os.environ, LD_LIBRARY_PATH=str(run.bin))  # its own libraries, not Corral's
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
        levels = bench(f"http://127.0.0.1:{port}", NAME, run.levels, run.work / "llama-server.json")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    return {"command": " ".join(cmd[:1] + cmd[3:]), "levels": levels}


def knee(run: Run) -> dict[str, Any]:
    """Aggregate tok/s with the cap out of the way; the cap worth having is the last level
    whose doubling still added 10%."""
    daemon = Daemon(run, "knee", MAX_SLOTS=str(max(run.knee)), NUM_PARALLEL="0")
    try:
        levels = bench(daemon.url, NAME, run.knee, run.work / "knee.json", per_client=2)
    finally:
        daemon.stop()
    cap = levels[0]["c"]
    for lower, upper in zip(levels, levels[1:]):
        if upper["tok_s"] >= 1.10 * lower["tok_s"]:
            cap = upper["c"]
        else:
            break
    from corral.runner import fitestimate
    guess = fitestimate.CPU_MAX_SLOTS if run.cpu else fitestimate.GPU_MAX_SLOTS
    return {"levels": levels, "measured_cap": cap, "guessed_cap": guess}


def _stop_on_term() -> None:
    """`timeout` ends the checks with SIGTERM: leave through the `finally` blocks, so no
    daemon or llama-server outlives them."""
    import signal

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(f"Error: stopped by signal {signum} (out of time)")
    signal.signal(signal.SIGTERM, leave)


def main() -> None:
    _stop_on_term()
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bin", type=Path, default=None, help="where llama-server is")
    parser.add_argument("--work", type=Path, default=None, help="models and raw files")
    parser.add_argument("--build-seconds", type=float, default=None)
    parser.add_argument("--cpu", action="store_true", help="the rehearsal: no CUDA")
    run = Run(parser.parse_args())
    # On a GPU the KV is device memory, where the runner keeps elastic per-slot streams
    # (runner.process.loading.layout) and check 5 reads their growth; the rehearsal's
    # KV is host memory, where the default is one shared buffer: it asks for the GPU's.
    daemon = Daemon(run, "default", **({"KV_POOL": "off"} if run.cpu else {}))
    try:
        made = run.step("model", lambda: make_model(run, run.tokenizer, daemon))
        if "error" not in made:
            run.step("full_offload", lambda: full_offload(run, daemon))
            run.step("half_offload", lambda: half_offload(run, daemon))
            run.step("corral", lambda: corral_levels(run, daemon))
    finally:
        daemon.stop()
    if "error" not in made:
        run.step("llama_server", lambda: llama_server(run))
        run.step("auto_cap", lambda: knee(run))
    print(table(run.result), flush=True)
    failed = [k for k, v in run.result["checks"].items() if "error" in v]
    if failed:
        raise SystemExit(f"Error: checks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
