"""Vision through the daemon: create, show, ps, every API, the CLI and bad input.

The model is the chat starter with a synthetic "mlp" projector
(tests/vision_model.py), created the ways users do: `files` with a projector
blob, and a Modelfile with a second FROM. Clients are the official packages.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import ollama
import openai
import pytest

from corral.registry.store import Store
from corral.server.daemon import Daemon
from tests.test_cli import CORRAL, corral, env_for
from tests.vision_model import (bmp_bytes, corrupt_webp, png_bomb, png_bytes, webp_bytes,
                                 write_projector)

pytestmark = pytest.mark.model

CHAT = "smollm2:135m"
VISION = "smol-vision"
GREEDY = {"temperature": 0, "seed": 1, "num_predict": 8}


@pytest.fixture(scope="module")
def daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    from tests.support import start_daemon

    d = start_daemon(starter_store, tmp_path_factory.mktemp("vision"), NUM_PARALLEL="2")
    yield d
    d.shutdown()


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pictures")
    out = {"projector": write_projector(root / "mmproj.gguf", "mlp", 576)}
    for name, data in (("one.png", png_bytes(40, 30, seed=1)),
                       ("two.png", png_bytes(40, 30, seed=2)),
                       ("three.bmp", bmp_bytes(20, 20, seed=3)),
                       ("four.webp", webp_bytes(40, 30, seed=4))):
        out[name] = root / name
        out[name].write_bytes(data)
    spaced = root / "my photos" / "one copy.png"
    spaced.parent.mkdir()
    spaced.write_bytes(png_bytes(40, 30, seed=1))
    out["spaced"] = spaced
    return out


@pytest.fixture(scope="module")
def vision(daemon: Daemon, pictures: dict[str, Path]) -> str:
    client = ollama.Client(host=daemon.url)
    projector = client.create_blob(pictures["projector"])
    # A bounded answer: the CLI's one-shot runs sample at the model's defaults.
    assert client.create(model=VISION, from_=CHAT, parameters={"num_predict": 24},
                         files={"mmproj.gguf": projector}).status == "success"
    return VISION


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def chat(d: Daemon, model: str, images: list[str], text: str = "What is this?"
         ) -> httpx.Response:
    return httpx.post(d.url + "/api/chat", timeout=120, json={
        "model": model, "stream": False, "options": GREEDY,
        "messages": [{"role": "user", "content": text, "images": images}]})


def test_show_tags_and_ps_report_the_projector(daemon: Daemon, vision: str,
                                               pictures: dict[str, Path]) -> None:
    client = ollama.Client(host=daemon.url)
    shown = httpx.post(daemon.url + "/api/show", json={"model": vision}).json()
    assert "vision" in shown["capabilities"]
    assert shown["projector_info"]["clip.projector_type"] == "mlp"
    assert shown["projector_info"]["general.architecture"] == "clip"
    froms = [ln for ln in shown["modelfile"].splitlines() if ln.startswith("FROM ")]
    digest = hashlib.sha256(pictures["projector"].read_bytes()).hexdigest()
    assert len(froms) == 2 and froms[1].endswith(f"sha256-{digest}")  # the weights, then it
    assert "vision" not in (client.show(CHAT).capabilities or [])
    tags = {m["name"]: m for m in httpx.get(daemon.url + "/api/tags").json()["models"]}
    assert "vision" in tags[f"{vision}:latest"]["capabilities"]
    for model in (CHAT, vision):
        client.generate(model=model, prompt="", keep_alive="5m")
    sizes = {m.model: int(m.size or 0) for m in client.ps().models}
    assert sizes[f"{vision}:latest"] - sizes[CHAT] == \
        pictures["projector"].stat().st_size


def test_ollama_client_chat_and_generate_with_image_paths(daemon: Daemon, vision: str,
                                                          pictures: dict[str, Path]) -> None:
    client = ollama.Client(host=daemon.url)
    question = [{"role": "user", "content": "What is this?"}]
    plain = client.chat(model=vision, messages=question, options=GREEDY)
    one = client.chat(model=vision, options=GREEDY, messages=[
        {**question[0], "images": [str(pictures["one.png"])]}])
    again = client.chat(model=vision, options=GREEDY, messages=[
        {**question[0], "images": [pictures["one.png"].read_bytes()]}])
    two = client.chat(model=vision, options=GREEDY, messages=[
        {**question[0], "images": [str(pictures["two.png"])]}])
    assert one.message.content == again.message.content
    assert one.message.content != plain.message.content
    assert two.message.content != one.message.content
    assert one.prompt_eval_count is not None and plain.prompt_eval_count is not None
    gen = client.generate(model=vision, prompt="Describe:", images=[str(pictures["three.bmp"])],
                          options=GREEDY)
    assert gen.response and gen.done


def test_openai_anthropic_and_responses_take_inline_images(daemon: Daemon, vision: str,
                                                           pictures: dict[str, Path]) -> None:
    uri = "data:image/png;base64," + b64(pictures["one.png"])
    native = chat(daemon, vision, [b64(pictures["one.png"])]).json()["message"]["content"]
    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    reply = oai.chat.completions.create(model=vision, temperature=0, seed=1, max_tokens=8,
                                        messages=[{"role": "user", "content": [
                                            # in front, where Ollama's `images` go
                                            {"type": "image_url", "image_url": {"url": uri}},
                                            {"type": "text", "text": "What is this?"}]}])
    assert reply.choices[0].message.content == native
    with pytest.raises(openai.BadRequestError) as remote:
        oai.chat.completions.create(model=vision, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert "remote images are not fetched" in remote.value.message
    assert remote.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    claude = anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0)
    message = claude.messages.create(model=vision, max_tokens=8, extra_body={
        "temperature": 0, "seed": 1}, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(pictures["one.png"])}},
            {"type": "text", "text": "What is this?"}]}])
    assert message.content[0].text  # type: ignore[union-attr]
    with pytest.raises(anthropic.BadRequestError, match="remote images"):
        claude.messages.create(model=vision, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}]}])
    responses = httpx.post(daemon.url + "/v1/responses", timeout=120, json={
        "model": vision, "max_output_tokens": 8, "temperature": 0, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                         {"type": "input_image", "image_url": uri}]}]})
    assert responses.status_code == 200, responses.text


def test_a_count_holds_the_images_tokens(daemon: Daemon, vision: str,
                                         pictures: dict[str, Path]) -> None:
    claude = anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(pictures["one.png"])}}
    ask: list[Any] = [{"role": "user", "content": [image, {"type": "text",
                                                          "text": "What is this?"}]}]
    r = httpx.post(daemon.url + "/api/generate", json={"model": vision, "keep_alive": 0},
                   timeout=60)
    assert r.json()["done_reason"] == "unload"  # cold: nothing of the prompt is cached
    counted = claude.messages.count_tokens(model=vision, messages=ask).input_tokens
    reply = claude.messages.create(model=vision, max_tokens=1, messages=ask)
    assert reply.usage.cache_read_input_tokens == 0
    assert reply.usage.input_tokens == counted
    text_only: list[Any] = [{"role": "user", "content": "What is this?"}]
    assert claude.messages.count_tokens(model=vision, messages=text_only).input_tokens < \
        counted - 8  # the image's own tokens are in the count


def test_a_model_without_a_projector_says_so(daemon: Daemon, pictures: dict[str, Path]) -> None:
    r = chat(daemon, CHAT, [b64(pictures["one.png"])])
    assert r.status_code == 400
    assert r.json()["error"] == "registry.ollama.ai/library/smollm2:135m does not support vision"
    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="does not support vision"):
        oai.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": [
            {"type": "image_url",
             "image_url": {"url": "data:image/png;base64," + b64(pictures["one.png"])}}]}])


def _corrupt_png() -> bytes:
    """A PNG whose header and end are intact but whose pixel data is noise: only the
    runner's decoder can tell."""
    good = png_bytes(40, 30, seed=4)
    return good[:41] + bytes(range(256)) * 2 + good[-12:]


BAD = {
    "truncated PNG": (base64.b64encode(png_bytes(40, 30)[:200]).decode(), "truncated"),
    "truncated JPEG": (base64.b64encode(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01"
                                        b"\x00\x01\x00\x00\xff\xc0\x00\x11\x08\x00\x10\x00\x10"
                                        b"\x03\x01\x22\x00\x02\x11\x01\x03\x11\x01").decode(),
                       "truncated"),
    "decompression bomb": (base64.b64encode(png_bomb()).decode(), "30000x30000 pixels"),
    "not an image": (base64.b64encode(b"hello, this is text").decode(), "not a supported"),
    "SVG": (base64.b64encode(b'<svg xmlns="http://www.w3.org/2000/svg"/>').decode(), "SVG"),
    "truncated WebP": (base64.b64encode(webp_bytes(40, 30)[:-20]).decode(),
                       "truncated or corrupt WebP"),
    "corrupt WebP": (base64.b64encode(corrupt_webp()).decode(),
                     "image 0 could not be decoded"),  # by the runner's libwebp
    "empty string": ("", "empty"),
    "invalid base64": ("!!not*base64!!", "not valid base64"),
    "corrupt pixels": (base64.b64encode(_corrupt_png()).decode(), "could not be decoded"),
}


def test_a_webp_is_answered_as_the_png_of_its_pixels(daemon: Daemon, vision: str,
                                                     pictures: dict[str, Path]) -> None:
    """A lossless WebP of one.png's pixels: the same greedy answer on Ollama's API and
    OpenAI's; asked again, its image's tokens come from the prompt cache."""
    webp = base64.b64encode(webp_bytes(40, 30, seed=1)).decode()
    png, got = chat(daemon, vision, [b64(pictures["one.png"])]), chat(daemon, vision, [webp])
    assert png.status_code == got.status_code == 200, got.text
    assert got.json()["message"]["content"] == png.json()["message"]["content"]
    again = chat(daemon, vision, [webp])
    assert again.json()["message"]["content"] == png.json()["message"]["content"]
    assert again.json()["prompt_eval_count"] < got.json()["prompt_eval_count"]
    r = httpx.post(daemon.url + "/v1/chat/completions", timeout=120, json={
        "model": vision, "temperature": 0, "seed": 1, "max_tokens": 8, "messages": [
            {"role": "user", "content": [  # in front of the text, as Ollama's `images` go
                {"type": "image_url", "image_url": {"url": "data:image/webp;base64," + webp}},
                {"type": "text", "text": "What is this?"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == png.json()["message"]["content"]


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_images_are_400s_and_the_daemon_keeps_serving(daemon: Daemon, vision: str,
                                                          case: str) -> None:
    image, words = BAD[case]
    r = chat(daemon, vision, [image])
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]


def test_too_many_images_then_a_good_request(daemon: Daemon, vision: str,
                                             pictures: dict[str, Path]) -> None:
    r = chat(daemon, vision, [b64(pictures["one.png"])] * 100)
    assert r.status_code == 400
    assert "too many images: 100 is over the limit of 16 (CORRAL_MAX_IMAGES)" in r.json()["error"]
    r = chat(daemon, vision, [b64(pictures["one.png"])])
    assert r.status_code == 200 and r.json()["message"]["content"]


def test_cli_attaches_image_paths_and_shows_the_projector(daemon: Daemon, vision: str,
                                                          pictures: dict[str, Path]) -> None:
    home = pictures["one.png"].parent
    for prompt in (f"What is this? '{pictures['spaced']}'",
                   "What is this? " + str(pictures["spaced"]).replace(" ", "\\ "),
                   "What is this? ~/one.png", "What is this? ~/four.webp"):
        out = corral(daemon, "run", vision, prompt, HOME=str(home))
        assert out.returncode == 0, out.stderr
        assert "Added image" in out.stderr
        assert out.stdout.strip()
    shown = corral(daemon, "show", vision)
    assert "Projector" in shown.stdout and "mlp" in shown.stdout
    import pexpect

    child = pexpect.spawn(CORRAL[0], [*CORRAL[1:], "run", vision], encoding="utf-8",
                          timeout=120, dimensions=(40, 100), env=env_for(daemon, HOME=str(home)))
    child.expect(">>> ")
    child.sendline("/show info")
    child.expect("Projector")
    child.expect(">>> ")
    child.sendline("/set parameter num_predict 4")
    child.expect(">>> ")
    child.sendline('What is in "~/one.png"?')
    child.expect("Added image")
    child.expect(">>> ")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    # A model without vision gets the path as text: nothing is read or attached.
    ollama.Client(host=daemon.url).create(model="smol-short", from_=CHAT,
                                          parameters={"num_predict": 8})
    plain = corral(daemon, "run", "smol-short", f"What is {pictures['one.png']}?")
    assert plain.returncode == 0 and "Added image" not in plain.stderr


def test_cli_create_with_a_second_from(daemon: Daemon, pictures: dict[str, Path],
                                       tmp_path: Path) -> None:
    mf = tmp_path / "Modelfile"
    mf.write_text(f"FROM {CHAT}\nFROM {pictures['projector']}\n")
    out = corral(daemon, "create", "smol-vision-2", "-f", str(mf))
    assert out.returncode == 0, out.stderr
    shown = httpx.post(daemon.url + "/api/show", json={"model": "smol-vision-2"}).json()
    assert "vision" in shown["capabilities"]
    # A projector whose width does not fit the model is refused with the reason.
    wrong = write_projector(tmp_path / "wide.gguf", "mlp", 640)
    mf.write_text(f"FROM {CHAT}\nFROM {wrong}\n")
    out = corral(daemon, "create", "smol-vision-3", "-f", str(mf))
    assert out.returncode == 1
    assert "Error: the projector's output width (640) does not match" in out.stderr
    assert json.loads(httpx.post(daemon.url + "/api/show",
                                 json={"model": "smol-vision-3"}).text)["error"]


def test_push_and_pull_carry_the_projector(daemon: Daemon, vision: str,
                                           pictures: dict[str, Path], tmp_path: Path) -> None:
    from tests.registry_server import FakeRegistry
    from tests.support import start_daemon

    reg = FakeRegistry()
    fresh = start_daemon(None, tmp_path)
    try:
        name = f"{reg.host}/alice/vision:v1"
        client = ollama.Client(host=daemon.url)
        client.copy(vision, name)
        assert client.push(name, insecure=True).status == "success"
        other = ollama.Client(host=fresh.url)
        assert other.pull(name, insecure=True).status == "success"
        shown = httpx.post(fresh.url + "/api/show", json={"model": name}).json()
        assert "vision" in shown["capabilities"] and shown["projector_info"]
        manifest = json.loads((tmp_path / "models" / "manifests" / reg.host / "alice" / "vision"
                               / "v1").read_text())
        assert "application/vnd.ollama.image.projector" in [
            layer["mediaType"] for layer in manifest["layers"]]
        want = chat(daemon, vision, [b64(pictures["two.png"])]).json()["message"]["content"]
        assert chat(fresh, name, [b64(pictures["two.png"])]).json()["message"]["content"] == want
    finally:
        fresh.shutdown()
        reg.close()


@pytest.mark.parametrize("leave_out,words", [
    (("v.blk.1.attn_out.weight",), "unable to find tensor v.blk.1.attn_out.weight"),
    (("mm.2.weight", "mm.2.bias"), "crashed"),  # llama.cpp dereferences the missing tensor
])
def test_a_projector_that_does_not_load_is_refused_at_create(
        daemon: Daemon, tmp_path: Path, leave_out: tuple[str, ...], words: str) -> None:
    client = ollama.Client(host=daemon.url)
    broken = write_projector(tmp_path / "broken.gguf", "mlp", 576, leave_out=leave_out)
    digest = client.create_blob(broken)
    with pytest.raises(ollama.ResponseError) as info:
        client.create(model="smol-broken", from_=CHAT, files={"mmproj.gguf": digest})
    assert "the projector does not load: " in str(info.value)
    assert words in str(info.value)  # llama.cpp's own reason, from the child's log
    assert "/blobs/" not in str(info.value)  # no server path goes back
    assert "smol-broken:latest" not in [m.model for m in client.list().models]
    assert client.show(CHAT).capabilities  # the daemon is still here


def photo(width: int, height: int) -> Any:
    """A photo-like picture: smooth light, edges and fine grain, as a camera's."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    grain = np.random.default_rng(7).integers(0, 24, (height, width, 3))
    rgb = np.stack([x / width * 200, y / height * 200, (x + y) % 97], axis=-1) + grain
    return Image.fromarray(rgb.clip(0, 255).astype("uint8"))


def test_a_16_mp_webp_photo_is_read_by_the_runner(daemon: Daemon, vision: str,
                                                  tmp_path: Path) -> None:
    """A 4000 x 4000 lossy WebP of several MB (the lossless PNG the daemon once made of
    it was over the runner's body limit) answers as the PNG of the same decoded pixels
    does, where a body limit lets that PNG through; the daemon process never maps
    libwebp, since only runners decode."""
    import io

    from PIL import Image

    out = io.BytesIO()
    photo(4000, 4000).save(out, format="WEBP", quality=90)
    webp = out.getvalue()
    assert len(webp) > 2 << 20
    with Image.open(io.BytesIO(webp)) as decoded:  # the same pixels, as a PNG
        png = io.BytesIO()
        decoded.convert("RGB").save(png, format="PNG", compress_level=1)
    here = chat(daemon, vision, [base64.b64encode(webp).decode()])
    assert here.status_code == 200, here.text
    too_big = chat(daemon, vision, [base64.b64encode(png.getvalue()).decode()])
    assert too_big.status_code == 413  # the PNG is over the default 16 MiB body
    # Through `corral serve`, a process of its own, whose maps are its own, with a body
    # limit that lets the PNG through.
    from tests.support import free_port, wait_for

    port = free_port()
    env = env_for(None, CORRAL_HOST=f"127.0.0.1:{port}", CORRAL_MODELS=str(daemon.store.root),
                  CORRAL_NUM_PARALLEL="1", CORRAL_CONTEXT_LENGTH="1024",
                  CORRAL_MAX_BODY=str(128 << 20), CORRAL_MAX_IMAGE_BYTES=str(96 << 20))
    import subprocess

    proc = subprocess.Popen([*CORRAL, "serve"], env=env, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout=60)
        answers = [httpx.post(url + "/api/chat", timeout=300, json={
            "model": vision, "stream": False, "options": GREEDY, "messages": [
                {"role": "user", "content": "What is this?",
                 "images": [base64.b64encode(data).decode()]}]}) for data in (webp, png.getvalue())]
        assert [a.status_code for a in answers] == [200, 200], answers[-1].text
        said = [a.json()["message"]["content"] for a in answers]
        assert said[0] == said[1] == here.json()["message"]["content"]
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "webp" not in maps.lower() and "libwebp" not in maps
    finally:
        proc.terminate()
        proc.wait(timeout=30)
