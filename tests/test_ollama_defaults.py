"""Corral's option defaults are Ollama's, field by field, as Ollama's own source sets them
(tests/peers/ollama/api/default_options.json: its DefaultOptions, as data). An option a
request leaves out on /api/generate or /api/chat (or a Modelfile, or `/set parameter`)
is then what Ollama would use; the few that differ on purpose are named with their
reason."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from corral.options import OPTION_TYPES, Options
from corral.runner.jobs import Job, SamplingParams
from corral.runner.loadconfig import LoadConfig
from corral.runner.speculative.draftmodel import N_MAX

PEER = json.loads((Path(__file__).parent / "peers/ollama/api/default_options.json").read_text())

# Corral's own choice, and why.
DIFFERENT = {
    # llama-server's --draft-max for a draft model: Ollama's 4 is for its own drafters.
    "draft_num_predict": N_MAX,
}


def corral_request_defaults() -> dict[str, object]:
    """What a request that sets no option runs with: its sampler's parameters, and the
    job's length and kept prefix (runner.process.service builds both from Options())."""
    params = SamplingParams.from_options(Options())
    job = {f.name: f.default for f in fields(Job) if f.name in ("num_predict", "num_keep")}
    return {**{f.name: getattr(params, f.name) for f in fields(SamplingParams)}, **job}


def test_every_request_default_is_ollamas() -> None:
    ours = corral_request_defaults()
    for name, value in PEER["request"].items():
        assert name in OPTION_TYPES, name  # an option Corral takes too
        assert ours[name] == value, (name, ours[name], value)
    # And no sampling default of ours is missing from Ollama's list.
    assert set(ours) <= set(PEER["request"])


def test_every_load_default_is_ollamas_but_the_named_ones() -> None:
    config = LoadConfig.from_options("m.gguf", Options())
    ours = {"num_batch": config.n_batch, "num_gpu": config.num_gpu,
            "num_thread": config.n_threads,
            "draft_num_predict": config.draft_num_predict or N_MAX}
    for name, value in PEER["load"].items():
        assert ours[name] == DIFFERENT.get(name, value), (name, ours[name], value)
