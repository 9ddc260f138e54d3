"""Settings: typed, defaults documented, CORRAL_* over OLLAMA_*, bad values fall back."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.config import (
    FOREVER,
    describe_settings,
    load_settings,
    parse_duration,
)
from corral.host import parse_host


def test_defaults() -> None:
    s = load_settings({})
    assert str(s.host) == "127.0.0.1:11434"
    assert s.models.name == "models"
    assert s.keep_alive == 300.0 and s.num_parallel == 0 and s.max_queue == 512
    assert s.context_length == 0 and s.kv_cache_type == "f16"  # 0: auto (fitestimate)
    assert s.api_key is None and s.noprune is False and s.flash_attention is None


def test_corral_names_win_over_ollama_names() -> None:
    s = load_settings({"OLLAMA_KEEP_ALIVE": "10m", "OLLAMA_MAX_QUEUE": "7",
                       "CORRAL_MAX_QUEUE": "9", "OLLAMA_MODELS": "/tmp/x"})
    assert s.keep_alive == 600.0 and s.max_queue == 9 and s.models == Path("/tmp/x")


def test_invalid_values_warn_and_fall_back(caplog: pytest.LogCaptureFixture) -> None:
    s = load_settings({"CORRAL_MAX_QUEUE": "many", "CORRAL_KEEP_ALIVE": "soon",
                       "CORRAL_CONTEXT_LENGTH": "2", "CORRAL_KV_CACHE_TYPE": "q3"})
    assert (s.max_queue, s.keep_alive, s.context_length, s.kv_cache_type) == (
        512, 300.0, 0, "f16")
    assert len(s.warnings) == 4
    assert "CORRAL_MAX_QUEUE" in caplog.text


def test_values_are_trimmed_of_quotes_and_spaces() -> None:
    s = load_settings({"CORRAL_NUM_PARALLEL": ' "3" ', "CORRAL_NOPRUNE": "yes",
                       "CORRAL_NOHISTORY": "false", "CORRAL_ORIGINS": "a, b ,"})
    assert s.num_parallel == 3 and s.noprune is True and s.nohistory is False
    assert s.origins == ("a", "b")


@pytest.mark.parametrize("value,on", [
    ("on", True), ("off", False), ("OFF", False), ("On", True), ("yes", True), ("no", False),
    ("1", True), ("0", False), ("true", True), ("False", False), ("t", True), ("F", False),
    (' "off" ', False),
])
def test_speculative_decoding_is_a_switch(value: str, on: bool) -> None:
    assert load_settings({}).speculative is True  # on by default
    assert load_settings({"CORRAL_SPECULATIVE": value}).speculative is on
    assert load_settings({"OLLAMA_SPECULATIVE": value}).speculative is on
    assert load_settings({"OLLAMA_SPECULATIVE": "off",
                          "CORRAL_SPECULATIVE": "on"}).speculative is True


def test_a_speculative_value_that_is_no_switch_warns_and_stays_on() -> None:
    s = load_settings({"CORRAL_SPECULATIVE": "disabled"}, warn=False)
    assert s.speculative is True and "CORRAL_SPECULATIVE" in s.warnings[0]


@pytest.mark.parametrize("text,url,loopback", [
    ("127.0.0.1:11434", "http://127.0.0.1:11434", True),
    (":8080", "http://127.0.0.1:8080", True),
    ("localhost", "http://localhost:11434", True),
    ("[::1]:9000", "http://[::1]:9000", True),
    ("0.0.0.0", "http://127.0.0.1:11434", False),
    ("http://10.0.0.5", "http://10.0.0.5:80", False),
    ("https://example.com/base/", "https://example.com:443/base", False),
    ("example.com", "https://example.com:443", False),
    ("1.2.3.4:notaport", "http://1.2.3.4:11434", False),
])
def test_host_forms(text: str, url: str, loopback: bool) -> None:
    host = parse_host(text)
    assert host.base_url() == url
    assert host.is_loopback() is loopback


@pytest.mark.parametrize("value,seconds", [
    ("5m", 300.0), ("1h30m", 5400.0), ("300", 300.0), (300, 300.0), ("1.5s", 1.5),
    ("0", 0.0), (0, 0.0), ("-1", FOREVER), (-5, FOREVER), ("-1m", FOREVER), ("500ms", 0.5),
])
def test_durations(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["abc", "5x", "", "m", True, None, [], float("nan")])
def test_bad_durations(value: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)


def test_help_lists_every_variable() -> None:
    text = describe_settings()
    for name in ("HOST", "MODELS", "KEEP_ALIVE", "NUM_PARALLEL", "MAX_LOADED_MODELS",
                 "MAX_QUEUE", "CONTEXT_LENGTH", "ORIGINS", "FLASH_ATTENTION", "KV_CACHE_TYPE",
                 "NOPRUNE", "NOHISTORY", "DEBUG", "LOAD_TIMEOUT", "API_KEY", "SPECULATIVE"):
        assert f"CORRAL_{name} " in text


def test_no_other_module_reads_the_environment() -> None:
    root = Path(__file__).resolve().parents[1] / "corral"
    offenders = []
    for pkg in ("api", "cli", "registry", "runner"):
        for path in (root / pkg).rglob("*.py"):
            if path.name == "config.py" and pkg == "api":
                continue
            text = path.read_text()
            if "os.environ" in text or "os.getenv" in text:
                offenders.append(str(path.relative_to(root)))
    assert offenders == []


def test_a_switch_reads_one_way_under_corrals_names_and_ollamas_way_under_its() -> None:
    from corral.config import load_settings

    on = {"CORRAL_DETERMINISTIC": "on", "CORRAL_KV_POOL": "yes", "CORRAL_NOPRUNE": "1",
          "CORRAL_SPECULATIVE": "true"}
    s = load_settings(on, warn=False)
    assert (s.deterministic, s.kv_pool, s.noprune, s.speculative) == (True, True, True, True)
    off = {"CORRAL_DETERMINISTIC": "off", "CORRAL_KV_POOL": "no", "CORRAL_NOPRUNE": "0",
           "CORRAL_SPECULATIVE": "false"}
    s = load_settings(off, warn=False)
    assert (s.deterministic, s.kv_pool, s.noprune, s.speculative) == (False, False, False,
                                                                      False)
    auto = load_settings({"CORRAL_KV_POOL": "auto"}, warn=False)
    assert auto.kv_pool is None and auto.shared_kv and not auto.warnings
    assert not load_settings({"CORRAL_KV_POOL": "auto", "CORRAL_DETERMINISTIC": "1"},
                             warn=False).shared_kv
    bad = load_settings({"CORRAL_FLASH_ATTENTION": "enabled"}, warn=False)
    assert bad.flash_attention is None and "CORRAL_FLASH_ATTENTION" in bad.warnings[0]
    # Ollama's rule for its own settings' names: ParseBool, and what does not parse is
    # true; a Corral switch under an OLLAMA_ name still reads Corral's way.
    ollama = load_settings({"OLLAMA_FLASH_ATTENTION": "enabled", "OLLAMA_NOPRUNE": "false",
                            "OLLAMA_NOHISTORY": "off", "OLLAMA_KV_POOL": "off"}, warn=False)
    assert (ollama.flash_attention, ollama.noprune, ollama.nohistory, ollama.kv_pool) == (
        True, False, True, False)
