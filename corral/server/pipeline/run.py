"""`run(services, request)`: the one generation path, for every API.

    view      the model, described once (server.chat.models: record, template, capabilities)
    prepare   a pure function of request x view: think, tools and tool_choice, grammars,
              images, options                    (pipeline/prepare.py; 400s, before any load)
    hold      the scheduler admits the request and holds a ready model (503, load errors)
    render    the prompt, in the daemon, with the runner's BOS and EOS
    stream    runner tokens -> ReplyParser -> Piece events; then one Finished per choice

`n` > 1 runs n sequences of the same prompt side by side (the runner decodes them
in one batch, and the second and later reuse the first's prefix); their events
interleave, each Piece and Finished carrying its choice's index.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator

from corral.errors import RunnerError
from corral.options import Options
from corral.runner.fim import Infill
from corral.runner.wire import CompletionJob, DoneLine, LoadReport, Logprob
from corral.server.chat.models import jinja_builder
from corral.server.pipeline.gbnf import check_gbnf
from corral.server.pipeline.leftout import left_out
from corral.server.pipeline.prepare import Plan, prepare
from corral.server.pipeline.request import (ChatTask, ChoiceMode, CompletionTask, Event,
                                            Finished, Task)
from corral.server.pipeline.toolgrammar import tool_grammar
from corral.server.chat.prompt import mark_messages, mark_prompt
from corral.server.chat.reply import Piece, ReplyParser

if TYPE_CHECKING:
    from corral.server.chat.prompt import PromptBuilder
    from corral.server.residency.scheduler import Resident
    from corral.server.pipeline.services import Services

OnDisconnect = Callable[[Callable[[], None]], threading.Event]


class Cancels:
    """Every sequence of one request, cancelled together (client gone, or a sibling failed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []
        self.fired = False

    def add(self, hook: Callable[[], None]) -> None:
        with self._lock:
            fired = self.fired
            if not fired:
                self._hooks.append(hook)
        if fired:
            hook()

    def fire(self) -> None:
        with self._lock:
            self.fired, hooks = True, list(self._hooks)
        for hook in hooks:
            hook()


def run(services: Services, request: Task, on_disconnect: OnDisconnect | None = None,
        admitted: Callable[[], None] | None = None) -> Iterator[Event]:
    """Check the request now; the returned events then hold, render and generate.
    `admitted` is called once the scheduler has taken the request and its model is
    ready: past that, what fails is no longer a full queue or a load (a live stream
    opens there)."""
    plan = prepare(services.models.view(request.model), request, services.settings)
    if plan.think_dropped:
        left_out(f"thinking on {plan.view.record.name.display()}", "the model cannot think; "
                 "this route drops `thinking` instead of refusing it, as Ollama's does")
    cancels = Cancels()
    return _events(services, plan, cancels, on_disconnect, admitted or _nothing)


def _nothing() -> None:
    pass


def _events(services: Services, plan: Plan, cancels: Cancels, on_disconnect: OnDisconnect | None,
            admitted: Callable[[], None]) -> Iterator[Event]:
    watcher = on_disconnect(cancels.fire) if on_disconnect is not None else None
    try:
        if plan.request.n == 1:
            yield from _choice(services, plan, 0, cancels, admitted)
        else:
            yield from _choices(services, plan, cancels, admitted)
    finally:
        if watcher is not None:
            watcher.set()


_END = object()


def _choices(services: Services, plan: Plan, cancels: Cancels, admitted: Callable[[], None]
             ) -> Iterator[Event]:
    """n sequences at once, each on a thread of its own that feeds one queue."""
    out: queue.Queue[Any] = queue.Queue()

    def work(index: int) -> None:
        try:
            for event in _choice(services, plan, index, cancels, admitted):
                out.put(event)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, who raises it
            out.put(exc)
        finally:
            out.put(_END)

    threads = [threading.Thread(target=work, args=(i,), daemon=True, name=f"choice-{i}")
               for i in range(plan.request.n)]
    for thread in threads:
        thread.start()
    left, finished = len(threads), False
    try:
        while left:
            item = out.get()
            if item is _END:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
        finished = True
    finally:
        if not finished:
            cancels.fire()  # a sibling failed or the reader left: stop the others


def _choice(services: Services, plan: Plan, index: int, cancels: Cancels,
            admitted: Callable[[], None]) -> Iterator[Event]:
    """One sequence: hold the model, render, stream pieces, end with its Finished."""
    model, started = plan.view.record.name.display(), time.perf_counter()
    job_id = uuid.uuid4().hex
    options = plan.options
    if index and options.seed is not None and options.seed >= 0:
        options = replace(options, seed=options.seed + index)  # n choices, n samples
    with services.scheduler.hold(plan.view.record, options, plan.request.keep_alive) as entry:
        runner = entry.runner
        assert runner is not None
        cancels.add(lambda: runner.cancel(job_id))
        load = time.perf_counter() - started
        if cancels.fired:
            services.metrics.request(model, "cancelled")
            return
        admitted()
        body, opened = _runner_body(plan, runner.report, options, job_id)
        parser = ReplyParser(plan.fmt, plan.tool_names,
                             thinking_open=opened)
        ended: list[DoneLine] = []
        yield from _stream(services, entry, body, parser, index, started, ended)
        stats = ended[-1] if ended else DoneLine()
        services.metrics.tokens(model, stats.prompt_eval_count, stats.eval_count,
                           stats.eval_duration)
        services.metrics.drafts(model, stats.draft_count, stats.draft_accepted_count)
        services.metrics.request(model, "cancelled" if cancels.fired else "ok")
        yield _final(stats, index, parser.calls > 0, load, started)


def _runner_body(plan: Plan, report: LoadReport, options: Options,
                 job_id: str) -> tuple[CompletionJob, bool]:
    """The runner's job: rendered text and images, and whether a think block is open."""
    request, shown = plan.request, render(plan, report)
    grammar = plan.grammar
    if isinstance(request, ChatTask) and request.tool_choice.forced:
        only = request.tool_choice.name if request.tool_choice.mode is ChoiceMode.NAMED else None
        grammar = tool_grammar(plan.fmt, plan.tools, only, bool(plan.think), shown.opened)
        check_gbnf(grammar)  # a tool's schema made it: as unchecked as a request's own
    job = CompletionJob(prompt=shown.text, add_bos=shown.add_bos, images=tuple(shown.images),
                        context=tuple(shown.context), grammar=grammar, options=options,
                        id=job_id, truncate=request.truncate, shift=request.shift,
                        special=plan.special,
                        logprobs=-1 if request.logprobs is None else request.logprobs,
                        infill=infill_of(plan),
                        # Only a templated completion answers with its tokens (Ollama's
                        # `context`; native.Lines shows them on the same rule).
                        return_context=isinstance(request, CompletionTask) and not request.raw)
    return job, shown.opened


def infill_of(plan: Plan) -> Infill | None:
    """The FIM prompt the runner assembles in place of the rendered text: /infill's, or
    a completion's prompt and suffix where the template does not render `.Suffix`
    (`prepare` let a suffix through only for a model that has one or the other)."""
    request = plan.request
    if isinstance(request, ChatTask):
        return None
    if request.infill is not None:
        return request.infill
    if request.suffix and not _renders_suffix(plan):
        return Infill(prefix=request.prompt, suffix=request.suffix, budgets=False)
    return None


def _renders_suffix(plan: Plan) -> bool:
    request = plan.request
    template = request.template if isinstance(request, CompletionTask) else None
    return ".Suffix" in (template or plan.view.template)


@dataclass(frozen=True)
class Rendered:
    text: str
    add_bos: bool
    images: list[str]  # base64, in the order of the text's media markers
    context: list[int]  # tokens before the text (native /api/generate's `context`)
    opened: bool  # the text ends inside a think block


def render(plan: Plan, report: LoadReport,
           builder: PromptBuilder | None = None) -> Rendered:
    """The prompt as the runner will tokenize it, through the model's template (or
    `builder`'s, for /corral/render's Jinja override)."""
    request = plan.request
    builder = builder or plan.view.builder(report.bos, report.eos)
    context: list[int] = []
    if isinstance(request, ChatTask):
        messages, images = mark_messages(plan.messages)
        text, add_bos = builder.chat(messages, plan.tools or None, plan.think)
    else:
        images, context = plan.images, list(request.context)
        prompt = mark_prompt(request.prompt, images)
        if request.raw and not (request.suffix and _renders_suffix(plan)):
            text, add_bos = prompt, True
        else:
            if request.template:
                builder = plan.view.builder(builder.bos, builder.eos, go=request.template)
            text, add_bos = builder.generate(prompt, request.system or plan.view.record.system,
                                             request.suffix, plan.think)
    opened = plan.fmt.think is not None and text.rstrip().endswith(plan.fmt.think[0])
    return Rendered(text, add_bos, images, context, opened)


def render_only(services: Services, request: Task, jinja: str | None = None, bos: str = "",
                eos: str = "") -> dict[str, Any]:
    """What `run` would send the runner, without generating: a Corral extension for
    reading a rendered prompt instead of inferring it (as llama-server's /apply-template).
    `jinja` tries a chat template of one's own (with its BOS and EOS text) instead of the
    model's."""
    view = services.models.view(request.model).with_template(jinja)
    plan = prepare(view, request, services.settings)
    report = LoadReport()
    go = view.record.template or (isinstance(request, CompletionTask)
                                  and (request.raw or request.template))
    builder = jinja_builder(jinja, bos, eos) if jinja else None
    if not go and builder is None:  # the GGUF's Jinja template needs the model's BOS/EOS
        with services.scheduler.hold(view.record, plan.options, request.keep_alive) as entry:
            report = entry.runner.report if entry.runner is not None else LoadReport()
    shown = render(plan, report, builder)
    return {"model": request.model, "prompt": shown.text, "add_bos": shown.add_bos,
            "images": len(shown.images), "think": plan.think, "thinking_open": shown.opened,
            "tools": [t.name for t in plan.tools]}


def _stream(services: Services, entry: Resident, body: CompletionJob, parser: ReplyParser,
            index: int, started: float, ended: list[DoneLine]) -> Iterator[Piece]:
    """The runner's lines as pieces; `ended` gets the final line."""
    runner, model = entry.runner, entry.record.name.display()
    assert runner is not None
    held: list[Logprob] = []  # log-probabilities wait for the piece their text makes
    first = True
    try:
        for line in runner.completion(body):
            if isinstance(line, DoneLine):
                ended.append(line)
                continue
            if first:
                first = False
                services.metrics.ttft(model, time.perf_counter() - started)
            held += line.logprobs
            yield from _tagged(parser.feed(line.content), held, index)
    except RunnerError:
        services.scheduler.runner_failed(entry)
        services.metrics.request(model, "error")
        raise
    yield from _tagged(parser.finish(), held, index)


def _tagged(pieces: list[Piece], held: list[Logprob], index: int) -> Iterator[Piece]:
    for piece in pieces:
        piece = replace(piece, index=index, logprobs=tuple(held)) if held or index else piece
        held.clear()
        yield piece


def _final(stats: DoneLine, index: int, called: bool, load: float, started: float) -> Finished:
    prompt = stats.prompt_tokens or stats.prompt_eval_count
    return Finished(index=index, done_reason=stats.done_reason, called=called,
                 prompt_tokens=prompt, cached_tokens=max(0, prompt - stats.prompt_eval_count),
                 eval_count=stats.eval_count,
                 prompt_eval_duration=stats.prompt_eval_duration,
                 eval_duration=stats.eval_duration, load_duration=load,
                 total_duration=time.perf_counter() - started, context=stats.context,
                 draft_count=stats.draft_count, draft_accepted_count=stats.draft_accepted_count)
