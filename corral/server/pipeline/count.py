"""Token counts and the model's tokenizer, for the routes that count without generating
(Anthropic's count_tokens, the Responses API's input_tokens, /api/tokenize, llama-server's
/tokenize).

A count is exact by construction: the request goes the generation path's way (prepare,
hold, render: pipeline/run.py), and the runner counts the tokens of the very job it would
have been sent, with `prompt_tokens`, the function /completion tokenizes with. The
template, the system prompt, the tools and the images are in it as they would be; nothing
is evaluated, so the prompt cache is untouched.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

from corral.errors import BadRequest
from corral.runner.wire import CompletionJob, Tokenize
from corral.server.pipeline.prepare import prepare
from corral.server.pipeline.request import Task
from corral.server.pipeline.run import render

if TYPE_CHECKING:
    from corral.server.residency.resident import Runner
    from corral.server.pipeline.services import Services


def count(services: Services, request: Task) -> int:
    """The tokens `request` would evaluate from a cold cache (its whole prompt)."""
    plan = prepare(services.models.view(request.model), request, services.settings)
    with services.scheduler.hold(plan.view.record, plan.options, request.keep_alive) as entry:
        runner = entry.runner
        assert runner is not None
        shown = render(plan, runner.report)
        return runner.count(CompletionJob(prompt=shown.text, add_bos=shown.add_bos,
                                          images=tuple(shown.images),
                                          context=tuple(shown.context)))


def tokenize(services: Services, model: str, command: Tokenize,
             keep_alive: float | None = None) -> list[Any]:
    """The model's own tokenizer (llama.cpp's, in its runner) on `command`'s text."""
    with _runner(services, model, keep_alive) as runner:
        return runner.tokens(command)


def detokenize(services: Services, model: str, tokens: list[int],
               keep_alive: float | None = None) -> str:
    with _runner(services, model, keep_alive) as runner:
        return runner.detokenize(tokens)


def only_loaded(services: Services) -> str:
    """The model a request that names none means (llama-server's /tokenize serves one
    model; Corral many): the one loaded, or a 400 that asks for a name."""
    names = sorted({entry.record.name.display() for entry in services.scheduler.running()})
    if len(names) == 1:
        return names[0]
    if not names:
        raise BadRequest("model is required: no model is loaded to default to")
    raise BadRequest(f"model is required: {len(names)} models are loaded "
                     f"({', '.join(names)}); name one")


@contextlib.contextmanager
def _runner(services: Services, model: str, keep_alive: float | None) -> Iterator[Runner]:
    """Hold `model` ready, loading it as a generation would, and give its runner."""
    view = services.models.view(model)
    with services.scheduler.hold(view.record, view.options(None), keep_alive) as entry:
        assert entry.runner is not None
        yield entry.runner
