"""Drafting with a model's own MTP head: Corral (which drafts with the head it finds in
the GGUF by default) against llama-server with `--spec-type draft-mtp` (its default
drafts with a model's head only where a draft model or sidecar is named), on the random
Qwen3.5 of the tests (tests/mtp_model.py: one `nextn` block that proposes about what the
model chose last).

Its weights mean nothing, so this measures what can be compared, not speed: whether
both servers answer alike (greedy, through `/v1/completions`, with a GBNF grammar that
forces an opening the head cannot foresee and then leaves the text free), and how many
tokens each drafted and kept (llama-server's `timings.draft_n` and `draft_n_accepted`,
which Corral reports the same way). Also Corral with speculation off, whose answers
must be the same. Prints the table and appends it to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/mtp.py [--threads N]
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare import llama_server_binaries, serve_gguf, start_llama_server  # noqa: E402

from corral.config import load_settings  # noqa: E402
from corral.process import physical_cores  # noqa: E402
from corral.registry.starter import CHAT_NAME, starter_model_path  # noqa: E402
from corral.registry.store import Store  # noqa: E402
from tests.mtp_model import write_mtp  # noqa: E402

MODEL = "bench-mtp"
NUM_CTX = 2048
PROMPTS = ["Once upon a time", "The quick brown fox", "Zebras are", "Hello",
           "In the beginning", "Dear diary,"]
GRAMMARS = {"free": None, "forced opening": 'root ::= "Once upon a time, there was a fox. " .*'}
MAX_TOKENS = 64


def answers(url: str, model: str) -> dict[tuple[str, str], tuple[str, int, int]]:
    """(prompt, grammar) -> (text, drafted, kept), one request at a time."""
    out = {}
    with httpx.Client(timeout=600) as client:
        for name, grammar in GRAMMARS.items():
            for prompt in PROMPTS:
                body: dict[str, Any] = {"model": model, "prompt": prompt, "temperature": 0,
                                        "max_tokens": MAX_TOKENS, "seed": 1}
                if grammar is not None:
                    body["grammar"] = grammar
                r = client.post(url + "/v1/completions", json=body)
                r.raise_for_status()
                data = r.json()
                timings = data.get("timings", {})
                out[(prompt, name)] = (data["choices"][0]["text"],
                                       int(timings.get("draft_n", 0)),
                                       int(timings.get("draft_n_accepted", 0)))
    return out


def corral(gguf: Path, tmp: Path, threads: int, speculative: bool
           ) -> dict[tuple[str, str], tuple[str, int, int]]:
    url, proc = serve_gguf(gguf, MODEL, tmp / ("on" if speculative else "off"),
                           CONTEXT_LENGTH=str(NUM_CTX), NUM_PARALLEL="1",
                           SPECULATIVE="on" if speculative else "off")
    try:
        return answers(url, MODEL)
    finally:
        proc.terminate()
        proc.wait(60)


def llama_server(binaries: Path, gguf: Path, threads: int
                 ) -> dict[tuple[str, str], tuple[str, int, int]]:
    url, proc = start_llama_server(binaries, gguf, 1, NUM_CTX, threads,
                                   "--spec-type", "draft-mtp")
    try:
        return answers(url, MODEL)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    threads = args.threads or physical_cores()
    chat_gguf = starter_model_path(Store(load_settings().models), CHAT_NAME)
    if chat_gguf is None:
        raise SystemExit("Error: the starters are not installed; run ./install.sh")
    binaries = llama_server_binaries()
    with tempfile.TemporaryDirectory() as tmp:
        gguf = write_mtp(chat_gguf, Path(tmp) / "bench-mtp.gguf")
        theirs = llama_server(binaries, gguf, threads)
        ours = corral(gguf, Path(tmp), threads, True)
        plain = corral(gguf, Path(tmp), threads, False)
    lines = [f"{'grammar':16} {'same text as llama-server':>26} {'as spec off':>12} "
             f"{'llama-server kept/drafted':>26} {'corral kept/drafted':>20}"]
    for name in GRAMMARS:
        keys = [(p, name) for p in PROMPTS]
        same = sum(theirs[k][0] == ours[k][0] for k in keys)
        same_off = sum(plain[k][0] == ours[k][0] for k in keys)
        t_d, t_k = sum(theirs[k][1] for k in keys), sum(theirs[k][2] for k in keys)
        o_d, o_k = sum(ours[k][1] for k in keys), sum(ours[k][2] for k in keys)
        lines.append(f"{name:16} {same:>20d} of {len(keys)} {same_off:>6d} of {len(keys)} "
                     f"{t_k:>18d}/{t_d:<7d} {o_k:>12d}/{o_d:<7d}")
    text = "\n".join(lines)
    print(text)
    with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
        f.write(f"\n## mtp.py {dt.date.today()} ({threads} threads; the random Qwen3.5 "
                f"with one MTP block, {MAX_TOKENS} tokens, greedy)\n\n```\n{text}\n```\n")


if __name__ == "__main__":
    main()
