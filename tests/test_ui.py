"""The page at /ui in a real headless Chromium, against the real daemon with the chat starter.

Playwright for Python drives Debian's `chromium` (installed by `install.sh --dev`). Every
request the page makes to anything but the daemon is refused and recorded, so the page is
shown to work offline. Where a test needs a model to say something exact (a `<script>`
tag) or to go on for long (Stop), it rewrites the page's own request on its way out, adding
a GBNF grammar or `ignore_eos`: the real model then streams real tokens through the real
daemon into the page. Screenshots for the README go to $CORRAL_UI_SCREENSHOTS when set.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from corral.cli.tables import processor
from corral.registry.store import Store
from corral.server.daemon import Daemon
from tests.gguf_files import write_tiny_gguf
from tests.support import start_daemon, wait_for
from tests.vision_model import png_bytes

# The test extra; absent, this is not a dev install.
sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is missing: "
                               ".venv/bin/python -m pip install -e '.[test]'")

CHAT = "smollm2:135m"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
# The flags a closed network needs: without them Chromium reaches for Google's hosts.
# Read at import: the suite's fixtures clear CORRAL_* from the environment of each test.
SHOTS = os.environ.get("CORRAL_UI_SCREENSHOTS")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def ui_daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(starter_store, tmp_path_factory.mktemp("ui"), NUM_PARALLEL="2")
    yield d
    d.shutdown()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is missing: sudo apt-get install chromium (./install.sh --dev "
                    "tries), or brew install chromium")
    # Its own home: Chromium writes its profile and caches there, never under the user's ~.
    home = tmp_path_factory.mktemp("chromium-home")
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "config"),
           "XDG_CACHE_HOME": str(home / "cache")}
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True, env=env)
        yield b
        b.close()


# Deadlines, not speed bounds. With a clean-clone CI run beside the suite, the wait for a
# grammar-forced answer (each pick checks the grammar over the whole vocabulary) ran out at
# 60 s here once.
ANSWERED_MS = 240_000
ACTION_MS = 120_000  # Playwright's own default, 30 s, for every click and wait


class Page:
    """One tab on the daemon's page, with its console errors and outside requests recorded."""

    def __init__(self, browser: Any, base: str) -> None:
        self.base = base
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", self._only_daemon)
        self.context.set_default_timeout(ACTION_MS)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def _only_daemon(self, route: Any) -> None:
        if route.request.url.startswith(self.base + "/"):
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()

    def open(self, view: str = "chat") -> Any:
        self.page.goto(f"{self.base}/ui#{view}")
        return self.page

    def rewrite_chat(self, **extra: Any) -> None:
        """Add fields to the page's next /api/chat bodies, as they leave the browser."""
        def add(route: Any) -> None:
            body = json.loads(route.request.post_data or "{}")
            body.update(extra)
            route.continue_(post_data=json.dumps(body))
        self.page.route("**/api/chat", add)

    def send(self, text: str, model: str = CHAT) -> None:
        page = self.page
        page.get_by_label("Model", exact=True).select_option(model)
        box = page.get_by_label("Message", exact=True)
        box.fill(text)
        box.press("Enter")

    def answer(self) -> Any:
        return self.page.get_by_role("log").locator("article.assistant").last

    def close(self, expected_errors: tuple[str, ...] = ()) -> None:
        errors = [e for e in self.errors if not any(x in e for x in expected_errors)]
        self.context.close()
        assert not self.outside, f"the page reached outside the daemon: {self.outside}"
        assert not errors, f"JavaScript errors: {errors}"


@pytest.fixture
def tab(browser: Any, ui_daemon: Daemon) -> Iterator[Page]:
    page = Page(browser, ui_daemon.url)
    yield page
    page.close()


def screenshot(page: Any, name: str, tmp_path: Path) -> None:
    folder = Path(SHOTS or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / name))
    assert (folder / name).stat().st_size > 1000


def create_thinker(daemon: Daemon) -> None:
    """`thinker`: the chat starter under a template that thinks (tests/test_reasoning.py)."""
    from tests.test_reasoning import TEMPLATE

    r = httpx.post(f"{daemon.url}/api/create", json={
        "model": "thinker", "from": CHAT, "template": TEMPLATE, "stream": False}, timeout=60)
    assert r.status_code == 200, r.text


def busy_slots(daemon: Daemon) -> int:
    models = httpx.get(f"{daemon.url}/api/ps").json()["models"]
    return sum(m["slots_busy"] for m in models)


def test_page_is_served_under_a_strict_policy(daemon_factory: Any) -> None:
    ui_daemon = daemon_factory(None, API_KEY="k")  # no model: the fast suite runs this
    r = httpx.get(f"{ui_daemon.url}/ui")  # the page's files need no key; its API calls do
    policy = r.headers["content-security-policy"]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in policy and "script-src 'self'" in policy
    assert "connect-src 'self'" in policy and "unsafe" not in policy
    assert httpx.get(f"{ui_daemon.url}/").text == "Corral is running"
    js = httpx.get(f"{ui_daemon.url}/ui/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{ui_daemon.url}/ui/..%2Fpage.py").status_code == 404
    assert httpx.get(f"{ui_daemon.url}/ui/nothing.js").status_code == 404
    assert httpx.get(f"{ui_daemon.url}/api/tags").status_code == 401
    assert httpx.post(f"{ui_daemon.url}/ui").status_code == 401  # only reading is open
    assert httpx.get(f"{ui_daemon.url}/ui", headers={"Host": "evil.example"}).status_code == 403


def test_chat_streams_an_answer_into_the_log(tab: Page, tmp_path: Path) -> None:
    page = tab.open()
    box = page.get_by_label("Message", exact=True)
    box.fill("a")
    box.press("Shift+Enter")
    box.type("b")
    assert box.input_value() == "a\nb"  # a new line, nothing sent
    assert page.get_by_role("log").locator("article").count() == 0
    # Count the answer's changes as they happen: a streamed answer changes more than once.
    page.evaluate("""() => { window.__changes = 0; new MutationObserver(() => window.__changes++)
        .observe(document.getElementById('transcript'), {subtree: true, childList: true,
                                                         characterData: true}); }""")
    tab.rewrite_chat(options={"temperature": 0, "seed": 1, "num_predict": 24})
    tab.send("Name three colors.")
    answer = tab.answer()
    answer.locator(".note").wait_for(timeout=ANSWERED_MS)  # "N tokens, X tokens/s" at the end
    assert answer.locator(".content").inner_text().strip()
    assert page.evaluate("window.__changes") > 3
    screenshot(page, "ui-chat.png", tmp_path)
    # The conversation is kept in the browser: a reload shows it again.
    page.reload()
    log = page.get_by_role("log")
    log.locator("article.assistant").first.wait_for()
    assert log.locator("article.user").last.inner_text().strip() == "Name three colors."


def test_model_output_with_markup_is_shown_as_text(tab: Page, tmp_path: Path) -> None:
    page = tab.open()
    words = ('<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"> **bold**'
             ' [run](javascript:window.pwned=3) [docs](https://example.com/a)'
             '\n```html\n<b>not bold</b>\n```\n'
             '| tag | safe |\n|---|---|\n| <i>x</i> | yes |\n')
    tab.rewrite_chat(grammar="root ::= " + json.dumps(words), options={"temperature": 0})
    tab.send("Say it.")
    answer = tab.answer()
    answer.locator(".note").wait_for(timeout=ANSWERED_MS)
    content = answer.locator(".content")
    assert "<script>window.pwned = 1</script>" in content.inner_text()
    assert content.locator("script, img").count() == 0
    assert content.locator("strong").inner_text() == "bold"  # Markdown still rendered
    assert content.locator("pre code").inner_text() == "<b>not bold</b>"  # a code block
    assert content.locator("b, i").count() == 0
    [link] = content.locator("a").all()  # only the https one became a link
    assert link.get_attribute("href") == "https://example.com/a" and link.inner_text() == "docs"
    assert "noopener" in (link.get_attribute("rel") or "")
    assert "[run](javascript:window.pwned=3)" in content.inner_text()
    assert content.locator("table td").all_inner_texts() == ["<i>x</i>", "yes"]  # a table
    assert page.evaluate("window.pwned") is None
    screenshot(page, "ui-markup.png", tmp_path)


def test_thinking_is_folded_and_tool_calls_are_shown(tab: Page, ui_daemon: Daemon) -> None:
    from tests.test_reasoning import TOOLS

    create_thinker(ui_daemon)
    page = tab.open()
    page.reload()  # the picker lists the new model
    page.get_by_label("Model", exact=True).select_option("thinker:latest")
    think = page.get_by_label("Think")
    think.wait_for()
    assert think.is_checked()  # a thinking model thinks unless told not to
    call = ('"Checking. <tool_call>{\\"name\\": \\"get_weather\\", \\"arguments\\": '
            '{\\"city\\": \\"Paris\\"}}</tool_call>"')
    tab.rewrite_chat(tools=TOOLS, options={"temperature": 0, "num_predict": 80},
                     grammar=f'root ::= [a-z]{{3,8}} " " [a-z]{{3,8}} "</think>" {call}')
    tab.send("Weather in Paris?", model="thinker:latest")
    answer = tab.answer()
    answer.locator(".note").wait_for(timeout=ANSWERED_MS)
    folded = answer.locator("details.thinking")
    assert folded.count() == 1 and folded.get_attribute("open") is None
    assert not answer.locator(".thinking-text").is_visible()
    folded.locator("summary").click()
    assert answer.locator(".thinking-text").inner_text().count(" ") == 1
    assert answer.locator(".content").inner_text().strip() == "Checking."
    assert answer.locator(".tool-call code").inner_text() == 'get_weather({"city":"Paris"})'


# Records the page's /api/show requests in the order it makes them, and marks each read
# once the page has its body: the page's own code after that read (the same microtask
# run) is done by the time a later evaluate() looks. shown(model, after) says whether
# such a request for `model` has been read (`after`: one made after the thinker's).
SHOWS = """
window.__shows = [];
const fetch0 = window.fetch;
window.fetch = function (path, init) {
  const answer = fetch0.apply(this, arguments);
  if (!String(path).endsWith("/api/show")) return answer;
  const entry = { model: JSON.parse(init.body).model, read: false };
  window.__shows.push(entry);
  return answer.then((response) => {
    const json = response.json.bind(response);
    response.json = () => json().then((body) => { entry.read = true; return body; });
    return response;
  });
};
window.shown = (model, after) => {
  const from = after ? window.__shows.findIndex((e) => e.model === "thinker:latest") + 1 : 0;
  return window.__shows.slice(from).some((e) => e.model === model && e.read);
};
"""


def test_a_late_answer_for_an_earlier_pick_does_not_count(tab: Page, ui_daemon: Daemon) -> None:
    """Picking a thinking model, then a text model, before the first one's details arrive:
    the page must not send `think` to the text model (it would refuse it with a 400)."""
    create_thinker(ui_daemon)
    held: list[Any] = []

    def hold_thinker(route: Any) -> None:
        if json.loads(route.request.post_data or "{}").get("model") == "thinker:latest":
            held.append(route)  # answered below, after the text model's
        else:
            route.continue_()
    tab.page.add_init_script(SHOWS)
    page = tab.open()
    page.route("**/api/show", hold_thinker)
    picker = page.get_by_label("Model", exact=True)
    page.locator('#model option[value="thinker:latest"]').wait_for(state="attached")
    picker.select_option("thinker:latest")
    wait_for(lambda: held or page.evaluate("0"), timeout=10)  # evaluate lets handlers run
    picker.select_option(CHAT)
    wait_for(lambda: page.evaluate(f"shown({json.dumps(CHAT)}, true)"), timeout=10)  # first
    held[0].continue_()
    wait_for(lambda: page.evaluate("shown('thinker:latest', false)"), timeout=10)
    assert not page.get_by_label("Think").is_visible()
    tab.rewrite_chat(options={"temperature": 0, "num_predict": 4})
    tab.send("Hi")
    tab.answer().locator(".note").wait_for(timeout=ANSWERED_MS)
    assert tab.answer().get_by_role("alert").count() == 0


def test_stop_ends_the_answer_and_frees_the_slot(browser: Any, ui_daemon: Daemon,
                                                 tmp_path: Path) -> None:
    chat, live = Page(browser, ui_daemon.url), Page(browser, ui_daemon.url)
    page = chat.open()
    chat.rewrite_chat(options={"ignore_eos": True, "num_predict": 4000, "temperature": 0})
    chat.send("Tell me a long story.")
    content = chat.answer().locator(".content")
    wait_for(lambda: len(content.inner_text()) > 20, timeout=60)
    # Meanwhile, in another tab, the live view shows the busy slot.
    view = live.open("live")
    card = view.locator(f'article[data-model="{CHAT}"]')
    card.locator('[data-field="busy"]').filter(has_text="1").wait_for(timeout=20_000)
    wait_for(lambda: float(card.locator('[data-field="rate"]').inner_text()) > 0, timeout=20)
    assert card.locator('[data-field="context"]').inner_text() == "1024"
    # Where the model is, as `corral ps` says it from /api/ps: CPU here, GPU on a GPU.
    [shown] = [m for m in httpx.get(f"{ui_daemon.url}/api/ps").json()["models"]
               if m["name"] == CHAT]
    where = processor(shown["size"], shown["size_vram"])
    assert card.locator('[data-field="processor"]').inner_text() == where
    points = 20 if SHOTS else 2  # the README's picture shows a stretch of the rate chart
    wait_for(lambda: int(card.locator("canvas").get_attribute("data-points") or 0) >= points,
             timeout=points + 20)
    screenshot(view, "ui-live.png", tmp_path)
    assert busy_slots(ui_daemon) == 1
    page.get_by_role("button", name="Stop").click()
    chat.answer().locator(".note").filter(has_text="Stopped").wait_for()
    wait_for(lambda: busy_slots(ui_daemon) == 0, timeout=10)
    length = len(content.inner_text())
    page.wait_for_timeout(1500)
    assert len(content.inner_text()) == length  # stopped growing
    card.locator('[data-field="busy"]').filter(has_text="0").wait_for(timeout=10_000)
    until = card.locator('[data-field="until"]')
    until.filter(has_text=re.compile(r"^\d+m \d+s$")).wait_for(timeout=10_000)  # counting down
    assert page.get_by_role("button", name="Send").is_visible()
    chat.close()
    live.close()


def test_an_image_on_a_text_model_is_refused_with_the_apis_message(tab: Page,
                                                                  ui_daemon: Daemon) -> None:
    png = png_bytes(2, 1, seed=3)
    direct = httpx.post(f"{ui_daemon.url}/api/chat", json={
        "model": CHAT, "stream": True,
        "messages": [{"role": "user", "content": "What is this?",
                      "images": [base64.b64encode(png).decode()]}]})
    assert direct.status_code == 400
    message = direct.json()["error"]
    page = tab.open()
    page.locator("#attach").set_input_files(
        files=[{"name": "dot.png", "mimeType": "image/png", "buffer": png}])
    page.get_by_label("Attachments").locator("img").wait_for()
    tab.send("What is this?")
    alert = page.get_by_role("log").get_by_role("alert")
    alert.wait_for(timeout=30_000)
    assert alert.inner_text() == message
    assert page.get_by_role("log").locator("article.user img").count() == 1  # kept, marked
    tab.errors = [e for e in tab.errors if "status of 400" not in e]  # the refusal itself


def test_models_pull_with_progress_show_and_delete(tab: Page, tmp_path: Path) -> None:
    from corral.registry import manifest as mt
    from tests.registry_server import FakeRegistry

    reg = FakeRegistry()
    model = write_tiny_gguf(tmp_path / "m.gguf", padding=1 << 20)
    reg.add_model("library", "pulled", "latest", [(mt.MODEL, model),
                                                   (mt.TEMPLATE, b"{{ .Prompt }}")])
    # The registry stops sending half-way until the bar has been seen part-way.
    reg.faults.hold_after = model.stat().st_size // 2
    try:
        page = tab.open("models")
        name = f"{reg.host}/library/pulled:latest"
        page.get_by_label("Model to pull").fill(name)
        page.get_by_label("Plain HTTP registry").check()
        page.get_by_role("button", name="Pull").click()
        bar = page.locator("#pull-progress")
        wait_for(lambda: 0 < float(bar.get_attribute("value") or 0) < float(
            bar.get_attribute("max") or 1), timeout=30)  # part-way
        reg.faults.resume.set()
        page.get_by_role("status").filter(has_text="success").wait_for(timeout=60_000)
        page.get_by_role("button", name=f"Show {name}").click()
        details = page.get_by_label("Model details")
        details.get_by_text("completion").wait_for()
        assert details.locator("h2").inner_text() == name and "null" not in details.inner_text()
        screenshot(page, "ui-models.png", tmp_path)
        page.get_by_role("link", name="Chat").click()  # the picker lists it without a reload
        page.locator(f'#model option[value="{name}"]').wait_for(state="attached")
        page.get_by_role("link", name="Models").click()
        page.locator("#model-rows[aria-busy]").wait_for(state="detached")  # drawn again
        delete = page.get_by_role("button", name=f"Delete {name}")
        delete.click()
        assert delete.inner_text() == "Confirm delete"
        delete.click()
        page.get_by_role("button", name=f"Show {name}").wait_for(state="detached")
        assert page.get_by_role("button", name=f"Show {CHAT}").is_visible()
    finally:
        reg.close()


def test_a_daemon_with_an_api_key_is_asked_for_it_once(browser: Any, starter_store: Store,
                                                       tmp_path: Path) -> None:
    d = start_daemon(starter_store, tmp_path / "keyed", API_KEY="s3cret")
    try:
        assert httpx.get(f"{d.url}/api/tags").status_code == 401
        tab = Page(browser, d.url)
        page = tab.open()
        page.get_by_label("API key").fill("s3cret")
        page.get_by_role("button", name="Use key").click()
        page.locator(f'#model option[value="{CHAT}"]').wait_for(state="attached")
        page.goto(f"{d.url}/ui#models")  # a reload within the tab: not asked again
        page.get_by_role("button", name=f"Show {CHAT}").wait_for()
        assert not page.get_by_label("API key").is_visible()
        tab.close(expected_errors=("status of 401",))
    finally:
        d.shutdown()


def with_projector(d: Daemon, name: str, projector: Path, num_predict: int) -> None:
    """The chat starter with a projector, created from an uploaded blob, greedy."""
    import hashlib

    data = projector.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert httpx.post(f"{d.url}/api/blobs/{digest}", content=data).status_code in (200, 201)
    r = httpx.post(f"{d.url}/api/create", timeout=120, json={
        "model": name, "from": CHAT, "files": {"mmproj.gguf": digest}, "stream": False,
        "parameters": {"num_predict": num_predict, "temperature": 0}})
    assert r.status_code == 200, r.text


def send_attached(tab: Any, element: str, file: Any, text: str, model: str
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Attach `file` on the page (shown as an <img> or <audio>), send `text` with it, and
    wait for the answer; (the request's body, the stream's last line). The page must
    have sent the file's own bytes and shown it in the transcript, not the composer."""
    page = tab.open()
    page.reload()
    page.locator("#attach").set_input_files(files=[file])
    page.get_by_label("Attachments").locator(element).wait_for()
    with page.expect_request(lambda r: r.url.endswith("/api/chat")) as request, \
            page.expect_response(lambda r: r.url.endswith("/api/chat")) as response:
        tab.send(text, model=model)
    answer = tab.answer()
    answer.locator(".note").wait_for(timeout=ANSWERED_MS)
    assert answer.get_by_role("alert").count() == 0
    assert page.get_by_role("log").locator(f"article.user {element}").count() == 1
    # Shown in front of the text, where the model reads Ollama's `images`.
    first = page.get_by_role("log").locator("article.user").last.evaluate(
        "n => n.firstElementChild.tagName")
    assert first.lower() == element
    assert page.get_by_label("Attachments").locator(element).count() == 0  # sent, cleared
    body = json.loads(request.value.post_data or "{}")
    assert body["messages"][-1]["images"] == [base64.b64encode(file["buffer"]).decode()]
    return body, json.loads(response.value.text().strip().splitlines()[-1])


def test_an_image_goes_to_a_vision_model(tab: Page, ui_daemon: Daemon, tmp_path: Path) -> None:
    from tests.vision_model import write_projector

    with_projector(ui_daemon, "looker", write_projector(tmp_path / "mmproj.gguf", "mlp", 576),
                   num_predict=12)
    png = png_bytes(40, 30, seed=1)
    body, final = send_attached(tab, "img", {"name": "one.png", "mimeType": "image/png",
                                             "buffer": png}, "What is this?", "looker:latest")
    assert tab.answer().locator(".content").inner_text().strip()
    # The model read the picture: the runner evaluated more tokens than the whole prompt
    # has without the image (its usage counts every prompt token, cached or not).
    text_only = [{"role": m["role"], "content": m["content"]} for m in body["messages"]]
    usage = httpx.post(f"{ui_daemon.url}/v1/chat/completions", timeout=120, json={
        "model": "looker:latest", "messages": text_only, "max_tokens": 1}).json()["usage"]
    assert final["done"] and final["prompt_eval_count"] > usage["prompt_tokens"]


def test_an_audio_clip_goes_to_an_audio_model(tab: Page, ui_daemon: Daemon,
                                              tmp_path: Path) -> None:
    from tests.audio_model import wav_bytes, write_audio_projector

    with_projector(ui_daemon, "listener", write_audio_projector(tmp_path / "qwen2a.gguf"),
                   num_predict=4)
    wav = wav_bytes(1.0, seed=3)
    _, final = send_attached(tab, "audio", {"name": "talk.wav", "mimeType": "audio/wav",
                                            "buffer": wav}, "Transcribe audio to text",
                             "listener:latest")
    assert final["done"] and final["prompt_eval_count"] > 750  # the clip's window was heard


def test_a_reranker_shows_its_capability_and_use(tab: Page, ui_daemon: Daemon,
                                                 reranker_gguf: Path) -> None:
    import ollama

    client = ollama.Client(host=ui_daemon.url)
    digest = client.create_blob(reranker_gguf)
    assert client.create(model="reranker", files={"r.gguf": digest}).status == "success"
    page = tab.open("models")
    page.get_by_role("button", name="Show reranker:latest").click()
    details = page.get_by_label("Model details")
    details.get_by_text("/v1/rerank", exact=False).wait_for()
    assert "rerank" in details.locator("dd").all_inner_texts()
    assert "completion" not in details.inner_text()
