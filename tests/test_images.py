"""Images without a model: header checks and limits, data URIs, CLI path extraction,
the prompt markers, and the engine's pure rules for image spans."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from corral.cli.images import extract_images, mentions_image
from corral.config import load_settings
from corral.errors import BadRequest
from corral.runner.engine.batchplan import plan_step, text_run
from corral.runner.engine.admission import align_prefix
from corral.runner.engine.imagefeed import check_images as check_spans
from corral.runner.jobs import Job
from corral.server.chat.messages import Message
from corral.server.chat.prompt import MEDIA_MARKER, mark_messages, mark_prompt
from corral.runner.slots.sequence import Sequence
from corral.runner.slots.slot import Slot, SlotState
from corral.runner.jobs import ImageSpan
from corral.server.chat.images import check_images, from_data_uri, measure
from tests.vision_model import bmp_bytes, corrupt_webp, png_bomb, png_bytes, webp_bytes

SETTINGS = load_settings({})


def enc(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_headers_give_format_and_size() -> None:
    assert measure(png_bytes(40, 30)) == ("png", 40, 30)
    assert measure(bmp_bytes(7, 5)) == ("bmp", 7, 5)
    gif = b"GIF89a" + (12).to_bytes(2, "little") + (9).to_bytes(2, "little") + b"\x00" * 8
    assert measure(gif) == ("gif", 12, 9)


@pytest.mark.parametrize("data,words", [
    (png_bytes(40, 30)[:100], "truncated or corrupt PNG"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", "truncated or corrupt JPEG"),
    (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "truncated or corrupt WebP"),
    (webp_bytes(40, 30)[:-20], "truncated or corrupt WebP"),
    (b"  <?xml version='1.0'?><svg/>", "SVG"),
    (b"PK\x03\x04 a zip", "not a supported image"),
])
def test_bad_headers_are_named(data: bytes, words: str) -> None:
    with pytest.raises(BadRequest, match=words):
        measure(data)


def test_limits_are_checked_before_decoding() -> None:
    with pytest.raises(BadRequest, match="30000x30000 pixels, over the limit"):
        check_images([enc(png_bomb())], SETTINGS)
    small = load_settings({"CORRAL_MAX_IMAGE_BYTES": "100", "CORRAL_MAX_IMAGES": "2"})
    with pytest.raises(BadRequest, match="over the limit of 100 bytes"):
        check_images([enc(png_bytes(40, 30))], small)
    with pytest.raises(BadRequest, match="too many images: 3 is over the limit of 2"):
        check_images(["a", "b", "c"], small)
    with pytest.raises(BadRequest, match="too many images: 3"):
        check_images(["a"], small, seen=2)  # counted across a chat's messages
    for bad, words in (("", "image 0 is empty"), ("%%%", "not valid base64"),
                       (5, "must be a base64 string")):
        with pytest.raises(BadRequest, match=words):
            check_images([bad], SETTINGS)
    with pytest.raises(BadRequest, match="must be a list"):
        check_images("abc", SETTINGS)
    good = enc(png_bytes(40, 30))
    assert check_images([good], SETTINGS) == [good]


def _webp_bomb() -> bytes:
    """An extended-format WebP header claiming a 30000 x 30000 canvas, and no pixels."""
    chunk = b"VP8X" + (10).to_bytes(4, "little") + bytes(4) + (29999).to_bytes(3, "little") * 2
    return b"RIFF" + (4 + len(chunk) + 20).to_bytes(4, "little") + b"WEBP" + chunk + bytes(20)


def test_webp_is_measured_checked_and_handed_on_as_it_came() -> None:
    """Lossy, lossless and animated WebP: sized from the header, limited before any pixel
    is decoded, and handed to the runner as the client sent it (the runner decodes it:
    the daemon decodes nothing)."""
    import io

    from PIL import Image

    for lossless in (True, False):
        assert measure(webp_bytes(37, 21, lossless=lossless)) == ("webp", 37, 21)
    frames = [Image.new("RGB", (50, 40), (40 * k, 0, 0)) for k in range(3)]
    animated = io.BytesIO()
    frames[0].save(animated, format="WEBP", save_all=True, append_images=frames[1:],
                   lossless=True)
    assert measure(animated.getvalue()) == ("webp", 50, 40)
    sent = enc(webp_bytes(40, 30, seed=1))
    assert check_images([sent], SETTINGS) == [sent]
    with pytest.raises(BadRequest, match="30000x30000 pixels, over the limit"):
        check_images([enc(_webp_bomb())], SETTINGS)
    # Its data is the runner's to find wrong (tests/test_vision_api.py): here only the header.
    assert check_images([enc(corrupt_webp())], SETTINGS) == [enc(corrupt_webp())]


def test_data_uris_only() -> None:
    assert from_data_uri("data:image/png;base64,QUJD") == "QUJD"
    assert from_data_uri("data:image/jpeg;name=x.jpg;base64,QUJD") == "QUJD"
    for url, words in (("https://example.com/a.png", "remote images are not fetched"),
                       ("file:///etc/passwd", "base64 data URI"),
                       ("data:image/png,rawbytes", "base64 data URI"), (None, "data URI")):
        with pytest.raises(BadRequest, match=words):
            from_data_uri(url)


def test_cli_finds_paths_with_quotes_spaces_and_home(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "a b").mkdir()
    (tmp_path / "a b" / "c d.png").write_bytes(b"png-bytes")
    (tmp_path / "e.JPG").write_bytes(b"jpg-bytes")
    text, images = extract_images(f"look at '{tmp_path}/a b/c d.png' and ~/e.JPG, please")
    assert text == "look at and , please"
    assert [base64.b64decode(i) for i in images] == [b"png-bytes", b"jpg-bytes"]
    text, images = extract_images(f"and {tmp_path}/a\\ b/c\\ d.png?")
    assert images and text == "and ?"
    # A path that is not a file stays in the text; words are not paths.
    assert extract_images("see ./missing.png") == ("see ./missing.png", [])
    assert not mentions_image("a png file and photo.jpg")


def test_prompt_markers_follow_ollama() -> None:
    img = enc(b"x")
    messages, images = mark_messages([
        Message("user", "first", (img,)),
        Message("user", "compare [img] with this", (img, img))])
    assert [m.content for m in messages] == [
        MEDIA_MARKER + "first", MEDIA_MARKER + f"compare {MEDIA_MARKER} with this"]
    assert images == [img] * 3  # still base64: the runner decodes, in marker order
    assert mark_prompt("hi", [img]) == MEDIA_MARKER + "hi"
    assert mark_prompt("hi", []) == "hi"


def span(start: int, n: int, key: int = -7, non_causal: bool = False) -> ImageSpan:
    return ImageSpan(start, key, np.zeros((n, 4), np.float32), non_causal)


def test_spans_must_match_the_placeholders() -> None:
    job = Job(prompt=[1, 2, -7, -7, -7, 3], images=(span(2, 3),))
    check_spans(job, n_vocab=10, n_batch=8)
    for bad in (Job(prompt=[1, -7, 3]), Job(prompt=[1, -7, -7], images=(span(1, 3),)),
                Job(prompt=[1, -7, -8, 3], images=(span(1, 2),)),
                Job(prompt=[1, 99], images=())):
        with pytest.raises(BadRequest):
            check_spans(bad, n_vocab=10, n_batch=8)
    with pytest.raises(BadRequest, match="more than num_batch"):
        check_spans(Job(prompt=[-7] * 9, images=(span(0, 9, non_causal=True),)), 10, 8)


def test_a_non_causal_image_is_reused_whole_or_not_at_all() -> None:
    spans = [span(2, 4, non_causal=True), span(8, 4)]
    assert align_prefix(spans, 4) == 2
    assert align_prefix(spans, 6) == 6 and align_prefix(spans, 2) == 2
    assert align_prefix(spans, 10) == 10  # a causal image may be reused in part


def test_text_prefill_stops_at_an_image() -> None:
    assert text_run([5, 6, -1, 7], 10) == 2 and text_run([-1, 5], 10) == 0
    assert text_run([5, 6, 7], 2) == 2
    image_first = Slot(seq_id=0, num_ctx=64, state=SlotState.PREFILL,
                       sequence=Sequence(Job(prompt=[1]), pending=[-1, -1, 4], t_start=1))
    text = Slot(seq_id=1, num_ctx=64, state=SlotState.PREFILL,
                sequence=Sequence(Job(prompt=[1]), pending=[1, 2, -1], t_start=2))
    plan = plan_step([image_first, text], n_batch=8)
    # The slot waiting on its image yields the batch to the next one's text.
    assert [(s.seq_id, n) for s, n in plan.prefill] == [(1, 2)]
    assert [row.token for row in plan.rows] == [1, 2] and not any(row.logits for row in plan.rows)
