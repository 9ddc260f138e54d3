"""The typed options record (one table, checked once, layered, back to JSON) and the
runner wire's typed job and token lines."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from corral.errors import InvalidOption
from corral.options import LOAD_OPTIONS, OPTION_TYPES, Options


def test_the_record_names_every_option_in_the_table() -> None:
    assert {f.name for f in fields(Options)} == set(OPTION_TYPES)


def test_parse_checks_and_normalises_once() -> None:
    got = Options.parse({"temperature": "0.5", "num_ctx": 2048.9, "stop": "END",
                         "mirostat": 2, "unknown": 1, "seed": None})
    assert (got.temperature, got.num_ctx, got.stop, got.seed) == (0.5, 2048, ("END",), None)
    with pytest.raises(InvalidOption):
        Options.parse({"top_p": 2})
    with pytest.raises(InvalidOption):
        Options.parse({"unknown": 1}, strict=True)
    with pytest.raises(InvalidOption):
        Options.parse(["temperature"])


def test_layers_win_field_by_field_and_go_back_to_json() -> None:
    model = Options.parse({"temperature": 0.2, "top_p": 0.9, "stop": ["a"]})
    request = Options.parse({"temperature": 0})
    merged = request.over(model)
    assert (merged.temperature, merged.top_p, merged.stop) == (0.0, 0.9, ("a",))
    assert model.temperature == 0.2  # frozen: a layer never changes the one beneath
    assert Options.parse(json.loads(json.dumps(merged.values()))) == merged
    assert Options().values() == {}


def test_only_load_fields_decide_a_reload() -> None:
    asked = Options.parse({"num_ctx": 2048, "temperature": 0.1}).load()
    assert set(asked.values()) == {"num_ctx"} and set(asked.values()) <= LOAD_OPTIONS
    loaded = Options(num_ctx=2048, num_batch=512)
    assert not asked.differs(loaded)  # what the request does not name never differs
    assert Options(num_ctx=4096).differs(loaded)
    assert Options(num_thread=2).differs(loaded)


def test_a_job_and_its_token_lines_cross_the_runner_wire_typed() -> None:
    from corral.runner.wire import CompletionJob, Logprob, TokenLine, read_line

    job = CompletionJob(prompt="hi", options=Options(temperature=0.0, stop=("END",), seed=3))
    assert CompletionJob.from_json(json.loads(json.dumps(job.to_json()))) == job
    entry = Logprob("a", -0.5, (97,), (Logprob("a", -0.5, (97,)), Logprob("b", -2.0, (98,))))
    line = TokenLine("a", (entry,))
    wire = json.loads(json.dumps(line.to_json()))
    assert "top_logprobs" not in wire["logprobs"][0]["top_logprobs"][0]  # OpenAI's shape
    assert read_line(wire) == line


def test_a_layered_stop_stays_a_tuple_in_the_record() -> None:
    merged = Options.parse({"stop": ["b"]}).over(Options.parse({"stop": ["a"]}))
    assert merged.stop == ("b",) and merged.values()["stop"] == ["b"]
