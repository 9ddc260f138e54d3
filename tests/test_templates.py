"""Go TEMPLATE subset, sandboxed Jinja, and prompt building. Pure: no model needed."""

from __future__ import annotations

import itertools

import pytest

from corral.registry.models import FALLBACK_TEMPLATE
from corral.server.chat.messages import Message
from corral.server.chat.prompt import PromptBuilder
from corral.server.chat.templates.gotemplate import GoTemplate, TemplateError
from corral.server.chat.templates.jinja import JinjaTemplate

MSGS = [{"Role": "user", "Content": "hi"}, {"Role": "assistant", "Content": "yo"},
        {"Role": "user", "Content": "more"}]


def render(src: str, **data: object) -> str:
    return GoTemplate(src).render(dict(data))


@pytest.mark.parametrize("src,data,expected", [
    ("{{ .System }}|{{ .Prompt }}", {"System": "s", "Prompt": "p"}, "s|p"),
    ("a  {{- .X -}}  b", {"X": 1}, "a1b"),
    ("{{/* comment */}}x", {}, "x"),
    ("{{ if .A }}yes{{ else if .B }}b{{ else }}no{{ end }}", {"A": "", "B": 1}, "b"),
    ("{{ if not .A }}empty{{ end }}", {"A": []}, "empty"),
    ("{{ if and .A (eq .B 2) }}ok{{ end }}", {"A": 1, "B": 2}, "ok"),
    ("{{ if or .A .B }}ok{{ end }}", {"A": 0, "B": "x"}, "ok"),
    ("{{ if ne .A 1 }}ne{{ end }}{{ if lt .A 5 }}lt{{ end }}", {"A": 2}, "nelt"),
    ("{{ range $i, $m := .Messages }}{{ $i }}:{{ $m.Role }};{{ end }}", {"Messages": MSGS},
     "0:user;1:assistant;2:user;"),
    ("{{ range .Messages }}{{ .Content }}{{ else }}none{{ end }}", {"Messages": []}, "none"),
    ("{{ with .Tool }}{{ .Name }}{{ else }}no tool{{ end }}", {"Tool": {"Name": "t"}}, "t"),
    ("{{ $n := len .Messages }}{{ $n }}", {"Messages": MSGS}, "3"),
    ("{{ range $i, $m := .Messages }}{{ if eq (len (slice $.Messages $i)) 1 }}last={{ $m.Content }}"
     "{{ end }}{{ end }}", {"Messages": MSGS}, "last=more"),
    ("{{ (index .Messages 1).Content }}", {"Messages": MSGS}, "yo"),
    ("{{ json .Tools }}", {"Tools": [{"a": "<b>"}]}, '[{"a":"\\u003cb\\u003e"}]'),
    ("{{ .Tools | json }}", {"Tools": [1, 2]}, "[1,2]"),
    ('{{ $x := "a" }}{{ if true }}{{ $x = "b" }}{{ end }}{{ $x }}', {}, "b"),
    ("{{ range .Messages }}{{ if eq .Role \"assistant\" }}{{ break }}{{ end }}{{ .Content }}"
     "{{ end }}", {"Messages": MSGS}, "hi"),
    ("{{ .Missing }}", {}, "<no value>"),
    ("{{ print \"a\" 1 }}{{ printf \"%s-%d\" \"x\" 2 }}", {}, "a1x-2"),
])
def test_go_template_constructs(src: str, data: dict, expected: str) -> None:
    assert render(src, **data) == expected


@pytest.mark.parametrize("src", [
    "{{ if .A }}unclosed", "{{ end }}", "{{ template \"x\" }}", "{{ define \"x\" }}{{ end }}",
    "{{ call .F }}", "{{ .A", "{{ undefinedfunc 1 }}", "{{ else }}", "{{ (len .A }}",
])
def test_unsupported_or_broken_templates_fail_at_load(src: str) -> None:
    with pytest.raises(TemplateError):
        GoTemplate(src)


def test_runtime_errors_are_template_errors() -> None:
    with pytest.raises(TemplateError):
        render("{{ $undefined }}")
    with pytest.raises(TemplateError):
        render("{{ index .A 5 }}", A=[1])


LIMIT = 100_000  # trace events a hostile render may take


@pytest.mark.parametrize("payload", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ self.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'] }}",
    "{% for i in range(10**9) %}x{% endfor %}",
    "{{ 'a' * 1000000000 }}",
    "{{ [1] * 100000000 }}",
    "{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ messages.append(1) }}",
])
def test_ssti_payloads_are_refused(payload: str) -> None:
    # The render's clock moves one tick each time it is read, at every trace event: its
    # time limit is a count of them, the same on any machine.
    reads = itertools.count()
    template = JinjaTemplate(payload, time_limit=LIMIT, clock=lambda: next(reads))
    with pytest.raises(TemplateError):
        template.render(messages=[{"role": "user", "content": "x"}])
    assert next(reads) <= LIMIT + 2  # stopped by then, by its limit or before it


def test_a_template_that_doubles_a_string_is_stopped_by_its_memory() -> None:
    """`~` cannot be intercepted, so the render watches its memory (every fourth trace
    event, through one descriptor of /proc/self/statm): unwatched, this renders a 1 GiB
    string's length, long before a generous time limit."""
    payload = ("{% set ns = namespace(s='a') %}{% for i in range(30) %}"
               "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}")
    with pytest.raises(TemplateError, match="memory"):
        JinjaTemplate(payload, time_limit=3600).render(messages=[])


def test_jinja_chat_template_renders() -> None:
    tmpl = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}\n"
            "{% endfor %}{% if add_generation_prompt %}<model>{% endif %}")
    builder = PromptBuilder(None, tmpl, bos="<bos>", eos="<eos>")
    text, add_bos = builder.chat([Message("user", " hi ")])
    assert text == "<bos><user>hi\n<model>" and add_bos is False


def test_fallback_and_messages_mode() -> None:
    builder = PromptBuilder()
    assert builder.kind == "fallback" and builder.go and builder.go.source == FALLBACK_TEMPLATE
    text, add_bos = builder.chat([
        Message("system", "Be brief."), Message("user", "Hi"),
        Message("assistant", " Hello."), Message("user", "Bye")])
    assert text == "Be brief.\n\nUser: Hi\nAssistant: Hello.\nUser: Bye\nAssistant:"
    assert add_bos is True


def test_legacy_template_runs_per_turn_and_cuts_last_response() -> None:
    builder = PromptBuilder("{{ if .System }}[S]{{ .System }}{{ end }}[U]{{ .Prompt }}[A]"
                            "{{ .Response }}[E]")
    text, _ = builder.chat([Message("system", "s"), Message("user", "a"),
                            Message("assistant", "b"), Message("user", "c")])
    assert text == "[S]s[U]a[A]b[E][U]c[A]"
