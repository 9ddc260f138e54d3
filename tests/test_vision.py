"""Vision in the runner: a real starter with a synthetic projector (tests/vision_model.py).

The answers are meaningless; what is checked is that the image reaches the
context and changes the answer, that the same image gives the same greedy
answer, that its tokens are reused and not encoded again, and that batching an
image beside text streams changes none of them. Two projector types: "mlp"
(LLaVA, causal, fed in slices) on the chat starter and "gemma3" (non-causal,
fed whole) on the base starter.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Iterator

import pytest

from corral.errors import CorralError
from corral.runner.jobs import Done, Failed, Token
from corral.runner.loadconfig import LoadConfig
from corral.registry.gguf import inspect_gguf
from corral.runner.process.main import build
from corral.runner.process.service import RunnerService
from corral.runner.wire import CompletionJob, DoneLine
from corral.server.chat.messages import Message
from corral.server.chat.prompt import PromptBuilder, mark_messages, mark_prompt
from tests.vision_model import png_bytes, write_projector

pytestmark = pytest.mark.model

GREEDY = {"temperature": 0, "seed": 1, "num_predict": 10}
IMG1 = base64.b64encode(png_bytes(40, 30, seed=1)).decode()
IMG2 = base64.b64encode(png_bytes(40, 30, seed=2)).decode()
IMAGE_TOKENS = 16  # (32 / 8)^2 for "mlp"; (32 / 4 / 2)^2 for "gemma3"


# The daemon renders prompts; these tests stand in for it with the model's own template.
BUILDERS: dict[int, PromptBuilder] = {}


def serve(model: Path, projector: Path, **config: Any) -> RunnerService:
    service = build(LoadConfig(model=str(model), projector=str(projector), **config))
    BUILDERS[id(service)] = PromptBuilder(None, inspect_gguf(model).chat_template,
                                          service.report.bos, service.report.eos)
    service.engine.start()
    return service


@pytest.fixture(scope="module")
def llava(chat_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunnerService]:
    proj = write_projector(tmp_path_factory.mktemp("proj") / "mlp.gguf", "mlp", 576)
    service = serve(chat_gguf, proj, n_slots=4, num_ctx=512, deterministic=True)
    yield service
    service.engine.stop()


@pytest.fixture(scope="module")
def gemma(starter_gguf: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[RunnerService]:
    proj = write_projector(tmp_path_factory.mktemp("proj") / "gemma3.gguf", "gemma3", 640)
    service = serve(starter_gguf, proj, n_slots=2, num_ctx=512, deterministic=True)
    yield service
    service.engine.stop()


def chat(images: list[str], question: str = "What is in this picture?") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question, "images": images}]}


def raw(images: list[str], prompt: str = "The picture shows") -> dict[str, Any]:
    return {"prompt": mark_prompt(prompt, images), "images": images}


def rendered(service: RunnerService, body: dict[str, Any]) -> dict[str, Any]:
    """A chat body as the daemon sends it: text with media markers, and the images."""
    if "messages" not in body:
        return body
    messages, images = mark_messages([Message.of(m) for m in body["messages"]])
    text, add_bos = BUILDERS[id(service)].chat(messages)
    rest = {k: v for k, v in body.items() if k != "messages"}
    return {**rest, "prompt": text, "add_bos": add_bos, "images": images}


def submit(service: RunnerService, body: dict[str, Any], **options: Any) -> Any:
    """The job, its Done line with the prompt's and reply's tokens (`context`)."""
    return service.job(CompletionJob.from_json({**rendered(service, body), "return_context": True,
                                                "options": {**GREEDY, **options}}))


def run(service: RunnerService, body: dict[str, Any], **options: Any
        ) -> tuple[str, DoneLine]:
    return collect(submit(service, body, **options))


def collect(job: Any) -> tuple[str, DoneLine]:
    text = []
    while True:
        event = job.events.get(timeout=120)
        if isinstance(event, Token):
            text.append(event.text)
        elif isinstance(event, Done):
            return "".join(text), event.stats
        else:
            assert isinstance(event, Failed)
            raise event.error


@pytest.mark.parametrize("which", ["llava", "gemma"])
def test_image_reaches_the_context_and_changes_the_answer(which: str,
                                                          request: pytest.FixtureRequest
                                                          ) -> None:
    service: RunnerService = request.getfixturevalue(which)
    body = chat if which == "llava" else raw
    plain, plain_stats = run(service, body([]))
    one, stats = run(service, body([IMG1]))
    again, _ = run(service, body([IMG1]))
    other, _ = run(service, body([IMG2]))
    # The image's tokens are in the prompt and counted (gemma3 adds its two markers).
    extra = IMAGE_TOKENS + (2 if which == "gemma" else 0)
    assert stats.prompt_tokens == plain_stats.prompt_tokens + extra
    assert one != plain and other != one
    assert again == one


def test_follow_up_reuses_the_image_and_does_not_encode_it_again(llava: RunnerService) -> None:
    first, stats = run(llava, chat([IMG1], "Describe it."))
    encoded = llava.vision.encoded
    # The same image, a different question: the prefix through the image is cached.
    _, follow = run(llava, chat([IMG1], "And what colour is it?"))
    assert follow.prompt_eval_count < follow.prompt_tokens - IMAGE_TOKENS
    assert llava.vision.encoded == encoded  # embeddings came from the cache
    # The context handed back holds no placeholder ids.
    assert follow.context and all(t >= 0 for t in follow.context)


def test_non_causal_image_is_never_reused_in_part(gemma: RunnerService) -> None:
    text, stats = run(gemma, raw([IMG1]))
    tokens, spans = gemma.prompt_tokens(CompletionJob.from_json(raw([IMG1])))
    span = spans[0]
    assert span.non_causal and tokens[span.start] < 0
    # Cut the cached prefix in the middle of the image: the next request must decode the
    # whole image again (its tokens attend both ways), and answer as before.
    slot = next(s for s in gemma.engine.slots if s.cached[:len(tokens) - 1] == tokens[:-1])
    del slot.cached[span.start + 5:]
    import llama_cpp as L

    L.llama_memory_seq_rm(gemma.engine.llama.mem, slot.seq_id, span.start + 5, -1)
    again, stats2 = run(gemma, raw([IMG1]))
    assert again == text
    assert stats2.prompt_eval_count >= len(tokens) - span.start


def test_image_beside_three_text_streams_changes_none(llava: RunnerService) -> None:
    prompts = ["The capital of France is", "Write a haiku about rain.", "Count to five:"]
    alone = [run(llava, chat([], p), num_predict=16)[0] for p in prompts]
    image_alone = run(llava, chat([IMG2], "Say what you see."))[0]
    for slot in llava.engine.slots:  # no cached prefix helps anyone this time
        slot.cached = []
        import llama_cpp as L

        L.llama_memory_seq_rm(llava.engine.llama.mem, slot.seq_id, -1, -1)
    jobs = [submit(llava, chat([], p), num_predict=16) for p in prompts]
    image_job = submit(llava, chat([IMG2], "Say what you see."))
    assert [collect(j)[0] for j in jobs] == alone
    assert collect(image_job)[0] == image_alone


def test_image_fed_in_slices_answers_as_whole(chat_gguf: Path, tmp_path: Path) -> None:
    # 64 x 64 pixels at patch 8: 64 image tokens, fed 32 a step (imagefeed.SLICE), and
    # 16 a step with num_batch 16.
    proj = write_projector(tmp_path / "mlp64.gguf", "mlp", 576, image_size=64)
    answers = []
    for n_batch in (512, 16):
        service = serve(chat_gguf, proj, n_slots=1, num_ctx=512, n_batch=n_batch,
                        deterministic=True)
        try:
            text, stats = run(service, chat([IMG1]))
            assert stats.prompt_eval_count == stats.prompt_tokens
            answers.append(text)
            steps = service.engine.steps
        finally:
            service.engine.stop()
    assert answers[0] == answers[1]
    assert steps >= 64 // 16 + 9  # four image slices, then ten tokens


def test_a_gemma_3_with_its_projector_keeps_only_the_window(chat_gguf: Path,
                                                           tmp_path: Path) -> None:
    """A sliding-window model loaded with its projector keeps a cache of the window's size
    (as llama-server's does), and a regenerate of a prompt with an image past the window
    reads one token: its checkpoints hold through the image (tests/test_window.py has
    the engine's side)."""
    from tests.window_model import WINDOW, write_window

    model = write_window(chat_gguf, tmp_path / "gemma3.gguf", seed=1)
    proj = write_projector(tmp_path / "proj.gguf", "gemma3", 64)
    service = serve(model, proj, n_slots=1, num_ctx=64 * WINDOW)
    try:
        assert service.engine.llama.window == WINDOW
        body = raw([IMG1], "The picture shows a fox by the river, and the birds in the "
                           "trees above it, and the fish in the cold clear water below")
        # an answer longer than the window: the slot's state cannot be cut back to the
        # prompt's end without a checkpoint
        first, stats = run(service, body, num_predict=2 * WINDOW)
        assert stats.prompt_tokens > IMAGE_TOKENS + 2 * WINDOW
        encoded = service.vision.encoded
        again, again_stats = run(service, body, num_predict=2 * WINDOW)
        assert again_stats.prompt_eval_count == 1 and again == first
        assert service.vision.encoded == encoded
    finally:
        service.engine.stop()


def test_bad_images_fail_the_request_not_the_runner(llava: RunnerService) -> None:
    bad = [base64.b64encode(b"not an image at all").decode(),
           base64.b64encode(png_bytes(40, 30)[:60]).decode()]
    for image in bad:
        with pytest.raises(CorralError) as info:
            run(llava, chat([image]))
        assert info.value.status == 400 and "image 0" in info.value.message
    with pytest.raises(CorralError, match="image markers"):
        run(llava, {"prompt": "<__media__> <__media__>", "images": [IMG1]})
    assert run(llava, chat([IMG1]))[0]  # and it still answers


def test_penalties_and_grammar_beside_an_image(llava: RunnerService) -> None:
    # The penalty history takes the prompt's tokens: never an image's placeholder ids.
    text, stats = run(llava, chat([IMG1]), repeat_penalty=1.3, repeat_last_n=64,
                      presence_penalty=0.5)
    assert stats.eval_count > 0 and text
    job = submit(llava, {**chat([IMG2]), "grammar": 'root ::= "yes" | "no"'})
    assert collect(job)[0] in ("yes", "no")
