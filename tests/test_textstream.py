"""Pure text streaming: UTF-8 never split, stop strings never emitted even in part."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from corral.runner.llama.textstream import StopMatcher, Utf8Stream


def test_multibyte_split_across_tokens() -> None:
    data = "안녕 🎉!".encode()
    stream = Utf8Stream()
    pieces = [stream.feed(data[i:i + 1]) for i in range(len(data))]
    assert "".join(pieces) + stream.flush() == "안녕 🎉!"
    assert all("\ufffd" not in p for p in pieces)


@given(st.text(), st.lists(st.integers(1, 7), max_size=50))
def test_any_split_reassembles(text: str, cuts: list[int]) -> None:
    data, stream, out, pos = text.encode(), Utf8Stream(), [], 0
    for cut in cuts:
        out.append(stream.feed(data[pos:pos + cut]))
        pos += cut
    out.append(stream.feed(data[pos:]))
    assert "".join(out) + stream.flush() == text


def test_stop_spanning_pieces_is_held_then_dropped() -> None:
    m = StopMatcher(["User:"])
    assert m.feed("Hello U").text == "Hello "
    r = m.feed("se")
    assert (r.text, r.stopped) == ("", False)
    r = m.feed("r: more")
    assert (r.text, r.stopped) == ("", True)


def test_false_alarm_is_released() -> None:
    m = StopMatcher(["User:"])
    assert m.feed("Us").text == ""
    assert m.feed("ual").text == "Usual"
    assert m.feed(" U").text == " "
    assert m.flush() == "U"


@given(st.text(alphabet="abU:ser", max_size=60), st.lists(st.integers(1, 5), max_size=30),
       st.sampled_from(["User:", "ab", "a", "sera"]))
def test_output_is_text_before_first_stop(text: str, cuts: list[int], stop: str) -> None:
    m, out, pos, stopped = StopMatcher([stop]), [], 0, False
    for cut in cuts + [len(text)]:
        r = m.feed(text[pos:pos + cut])
        pos += cut
        out.append(r.text)
        if r.stopped:
            stopped = True
            break
    emitted = "".join(out) + ("" if stopped else m.flush())
    full_seen = text[:pos]
    if stop in full_seen:
        assert stopped and emitted == full_seen[: full_seen.index(stop)]
    else:
        assert emitted == full_seen and not stopped
