"""`corral` commands. Every failure prints `Error: <message>` to stderr and exits 1."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from corral.process import package_parent
from corral.api.client import Client
from corral.cli import tables
from corral.cli.progress import show_progress
from corral.cli.runoptions import RunOptions
from corral.config import (Settings, child_environment, describe_settings, load_settings,
                           parse_duration)
from corral.errors import CorralError
from corral.version import corral_version

# "\b" alone on a line keeps click from re-wrapping the paragraph that follows it.
EXAMPLES = """
Examples:

\b
  corral run smollm2:135m                chat with the starter model
  corral run gemma3:270m-base "Hi"       one answer, then exit
  cat notes.txt | corral run MODEL "Summarize:"
  corral pull llama3.2                   fetch a model from the registry
  corral list                            models in the store
  corral ps                              loaded models
  open http://127.0.0.1:11434/ui         chat and a live view in the browser
"""

app = typer.Typer(help="Corral runs local models behind an Ollama-compatible API.\n" + EXAMPLES,
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  pretty_exceptions_enable=False)


class _State:
    settings: Optional[Settings] = None


def settings() -> Settings:
    if _State.settings is None:
        _State.settings = load_settings()
    return _State.settings


def client(start: bool = True, preload: str | None = None) -> Client:
    """A client for the daemon, starting one in the background when none answers."""
    c = Client(settings())
    if start:
        log = c.ensure_daemon(preload=preload)
        if log is not None:
            typer.echo(f"Started corral server in the background (log: {log})", err=True)
    return c


def _version(value: bool) -> None:
    if value:
        typer.echo(f"corral version {corral_version()}")
        raise typer.Exit()


@app.callback()
def _root(show_version: bool = typer.Option(False, "--version", "-v", callback=_version,
                                            is_eager=True, help="Show the version.")) -> None:
    """Corral: local models, an Ollama-compatible API, continuous batching."""


@app.command(epilog=describe_settings())
def serve() -> None:
    """Start the daemon (Ollama-compatible API on CORRAL_HOST)."""
    from corral.server.daemon import run

    run(settings())


@app.command("list")
def list_models(prefix: str = typer.Argument("", help="Only names starting with this.")) -> None:
    """List models in the store."""
    models = [m for m in client().tags() if m["name"].lower().startswith(prefix.lower())]
    typer.echo(tables.models_table(models))


app.command("ls", hidden=True)(list_models)


@app.command()
def ps() -> None:
    """List loaded models."""
    typer.echo(tables.ps_table(client().ps()))


@app.command()
def pull(model: str, insecure: bool = typer.Option(False, help="Allow a plain-HTTP registry.")
         ) -> None:
    """Pull a model from a registry."""
    show_progress(client().stream("/api/pull", {"model": model, "insecure": insecure}))


@app.command("rpc-server")
def rpc_server(host: str = typer.Option("127.0.0.1", help="Address to listen on; anything "
                                        "but loopback must be a trusted network."),
               port: int = typer.Option(50052, help="Port to listen on."),
               threads: int = typer.Option(0, help="CPU threads (0: all cores)."),
               cache: Optional[Path] = typer.Option(None, help="Tensor cache directory "
                                                    "(off unless given).")) -> None:
    """Serve this machine's best device to other hosts' models (llama.cpp RPC)."""
    import os

    argv = [sys.executable, "-m", "corral.runner.tools.rpc", "--host", host, "--port", str(port),
            "--threads", str(threads)]
    if cache is not None:
        argv += ["--cache", str(cache.resolve())]
    os.chdir(package_parent())
    sys.stdout.flush()
    os.execv(sys.executable, argv)  # the worker is the process: signals reach it directly


@app.command()
def push(model: str, insecure: bool = typer.Option(False, help="Allow a plain-HTTP registry.")
         ) -> None:
    """Push a model to a registry."""
    show_progress(client().stream("/api/push", {"model": model, "insecure": insecure}))


@app.command()
def show(model: str,
         license: bool = typer.Option(False, "--license"),
         modelfile: bool = typer.Option(False, "--modelfile"),
         parameters: bool = typer.Option(False, "--parameters"),
         system: bool = typer.Option(False, "--system"),
         template: bool = typer.Option(False, "--template"),
         verbose: bool = typer.Option(False, "--verbose", "-v",
                                      help="Add the metadata and tensors.")) -> None:
    """Show a model's details, or one of its parts."""
    flags = {"license": license, "modelfile": modelfile, "parameters": parameters,
             "system": system, "template": template}
    chosen = [k for k, v in flags.items() if v]
    if len(chosen) > 1:
        raise CorralError("only one of '--license', '--modelfile', '--parameters', '--system', "
                          "or '--template' can be specified")
    info = client().show(model, verbose=verbose)
    if chosen:
        typer.echo(info.get(chosen[0], "") or "")
    else:
        typer.echo(tables.show_text(info))


@app.command()
def rm(models: List[str]) -> None:
    """Remove models (unloading them first)."""
    c = client()
    for model in models:
        c.delete(model)
        typer.echo(f"deleted '{model}'")


@app.command()
def cp(source: str, destination: str) -> None:
    """Copy a model under a new name."""
    client().copy(source, destination)
    typer.echo(f"copied '{source}' to '{destination}'")


@app.command()
def stop(model: str) -> None:
    """Unload a running model."""
    client().stop(model)


def _upload(c: Client, ref: str, base: Path) -> tuple[str, str]:
    """A Modelfile's local GGUF (FROM or ADAPTER) sent as a blob: (file name, digest)."""
    from corral.registry.create import local_model_file
    from corral.registry.store import file_sha256

    path = local_model_file(ref, base)  # refuse a bad file before uploading it
    digest = file_sha256(path)
    typer.echo(f"copying file {digest}", err=True)
    c.create_blob(path, digest)
    return path.name, digest


@app.command()
def create(name: str, file: Path = typer.Option(Path("Modelfile"), "--file", "-f",
                                                help="The Modelfile (default ./Modelfile)."),
           quantize: Optional[str] = typer.Option(
               None, "--quantize", "-q", help="Quantize the model: q4_K_M, q4_K_S, q5_K_M, "
               "q8_0, f16, ..."),
           requantize: bool = typer.Option(
               False, "--requantize", help="Allow quantizing a model that is already "
               "quantized (quality drops).")) -> None:
    """Create a model from a Modelfile."""
    from corral.registry.create import looks_like_path
    from corral.registry.derive import file_type
    from corral.registry.modelfile import parse_modelfile

    if quantize is not None:
        file_type(quantize)  # a bad type fails before any upload
    if not file.is_file():
        raise CorralError(f"specified Modelfile wasn't found: {file}")
    mf = parse_modelfile(file.read_text(encoding="utf-8", errors="replace"))
    c = client()
    body: dict[str, object] = {"model": name, "template": mf.template, "system": mf.system,
                               "license": mf.licenses, "parameters": mf.parameters,
                               "messages": mf.messages, "quantize": quantize}
    if requantize:
        body["requantize"] = True
    if looks_like_path(mf.from_):
        body["files"] = dict([_upload(c, mf.from_, file.parent)])
    else:
        body["from"] = mf.from_
    if mf.projectors:  # a second FROM: the vision projector
        body["files"] = {**body.get("files", {}),  # type: ignore[dict-item]
                         **dict(_upload(c, ref, file.parent) for ref in mf.projectors)}
    if mf.adapters:
        body["adapters"] = dict(_upload(c, ref, file.parent) for ref in mf.adapters)
    if mf.draft and looks_like_path(mf.draft):  # DRAFT: a file is uploaded, a name sent
        body["draft_files"] = dict([_upload(c, mf.draft, file.parent)])
    elif mf.draft:
        body["draft"] = mf.draft
    show_progress(c.stream("/api/create", {k: v for k, v in body.items() if v is not None}))



@app.command()
def run(model: str,
        prompt: List[str] = typer.Argument(None, help="Answer this and exit."),
        verbose: bool = typer.Option(False, "--verbose", help="Print timings after answers."),
        format: str = typer.Option("", "--format", help="Response format, e.g. json."),
        keepalive: str = typer.Option("", "--keepalive", help="How long to keep the model."),
        think: Optional[str] = typer.Option(None, "--think", help="Ask a thinking model to "
                                            "think: --think, or "
                                            "--think=low|medium|high|max|false."),
        hidethinking: bool = typer.Option(False, "--hidethinking",
                                          help="Do not show the model's thinking."),
        nowordwrap: bool = typer.Option(False, "--nowordwrap", help="Do not wrap words."),
        insecure: bool = typer.Option(False, "--insecure", help="Pull over plain HTTP.")) -> None:
    """Run a model: one answer with a PROMPT or piped input, else an interactive chat."""
    from corral.cli import repl

    c = client(preload=model)
    if not c.exists(model):
        show_progress(c.stream("/api/pull", {"model": model, "insecure": insecure}))
    _refuse_reranker(c, model)
    keep_alive = None
    if keepalive:
        try:
            parse_duration(keepalive)
        except ValueError:
            raise CorralError(f"invalid duration {keepalive!r}") from None
        keep_alive = keepalive
    text = " ".join(prompt or [])
    if not sys.stdin.isatty():
        piped = sys.stdin.read()
        text = f"{text}\n\n{piped}".strip() if text else piped
    opts = RunOptions(model=model, verbose=verbose, format=format or None,
                           keep_alive=keep_alive, think=_think_flag(think),
                           hide_thinking=hidethinking, wordwrap=not nowordwrap,
                           history=not settings().nohistory)
    if text or not sys.stdin.isatty() or not sys.stdout.isatty():
        repl.one_shot(c, opts, text)
    else:
        repl.interactive(c, opts)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(ctx: typer.Context,
           agent: str = typer.Argument("", help="claude, codex or opencode; none: list them."),
           model: str = typer.Option("", "--model", "-m", help="The model the agent uses.")
           ) -> None:
    """Run a coding agent against Corral: corral launch AGENT --model MODEL [-- ARGS]."""
    import subprocess

    from corral.cli import agents

    if not agent:
        typer.echo(agents.listing())
        return
    spec = agents.agent_named(agent)
    binary = spec.find()
    if binary is None:
        raise CorralError(f"{spec.title} is not installed; install it with: {spec.install}")
    c = client()
    if model and not c.exists(model):
        show_progress(c.stream("/api/pull", {"model": model}))
    run_as = spec.build(binary, agents.target(c, model, settings().api_key), list(ctx.args))
    if run_as.warning:
        typer.echo(f"Warning: {run_as.warning}", err=True)
    raise typer.Exit(subprocess.call(run_as.argv, env=child_environment(run_as.env)))


def _refuse_reranker(c: Client, model: str) -> None:
    """A reranker cannot chat: say what it is for instead of starting a chat that fails."""
    if "rerank" in (c.show(model).get("capabilities") or []):
        raise CorralError(
            f"{model} is a reranker: it scores documents against a query and cannot chat. "
            f"Send it to the rerank API, e.g. curl {c.base}/v1/rerank -d '{{\"model\": "
            f"\"{model}\", \"query\": \"...\", \"documents\": [\"...\", \"...\"]}}'")


def _think_flag(value: str | None) -> bool | str | None:
    if value is None:
        return None
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("low", "medium", "high", "max"):
        return lowered  # the daemon reads "max" as "high" (api.wire.common)
    raise CorralError(f"invalid value for --think: {value!r} "
                      "(use true, false, low, medium, high or max)")


@app.command()
def bench(model: str,
          concurrency: str = typer.Option("1,2,4,8", help="Closed-loop sweep levels."),
          request_rate: float = typer.Option(0.0, help="Open loop: Poisson arrivals per second."),
          max_concurrency: int = typer.Option(0, help="Open loop: most requests in flight."),
          requests: int = typer.Option(0, help="Requests per level (default per-client x "
                                                  "concurrency)."),
          per_client: int = typer.Option(4, "--per-client", help="Requests per client and level."),
          prompt_tokens: int = typer.Option(32, help="Prompt length in tokens."),
          max_tokens: int = typer.Option(64, help="Tokens to generate, exactly."),
          dataset: str = typer.Option("random", help="random, or chat (multi-turn)."),
          seed: int = typer.Option(0),
          api: str = typer.Option("native", help="native or openai."),
          base_url: str = typer.Option("", help="Any Ollama- or OpenAI-compatible server."),
          json_path: Optional[Path] = typer.Option(None, "--json", help="Write results here."),
          plot_dir: Optional[Path] = typer.Option(None, "--plot-dir",
                                                  help="Where charts go (plot extra).")) -> None:
    """Benchmark a server: TTFT, TPOT, ITL and throughput across concurrency levels."""
    from corral.cli import bench as b
    from corral.cli.benchreport import print_report

    if api not in ("native", "openai") or dataset not in ("random", "chat"):
        raise CorralError("--api must be native or openai, --dataset random or chat")
    try:
        levels = [int(x) for x in concurrency.split(",") if x.strip()]
    except ValueError:
        raise CorralError(f"invalid --concurrency {concurrency!r}") from None
    if not levels or min(levels) < 1 or max_tokens < 1 or prompt_tokens < 1:
        raise CorralError("concurrency, --max-tokens and --prompt-tokens must be positive")
    url = base_url.rstrip("/") or client().base
    cfg = b.BenchConfig(model=model, base_url=url, api=api, requests=requests,
                        per_client=per_client, prompt_tokens=prompt_tokens, max_tokens=max_tokens, dataset=dataset,
                        seed=seed, request_rate=request_rate, max_concurrency=max_concurrency)
    summaries = print_report(cfg, levels if request_rate <= 0 else [max_concurrency or 1])
    if json_path is not None:
        b.save_json(json_path, cfg, summaries)
    charts = b.plot(summaries, plot_dir or (json_path.parent if json_path else Path(".")))
    for chart in charts:
        typer.echo(f"chart: {chart}", err=True)
    if not charts:
        typer.echo("charts need the plot extra: pip install 'corral[plot]'", err=True)


def main() -> None:
    try:
        # Outside standalone mode typer returns exit codes (130 for Ctrl-C) instead of exiting.
        code = app(standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except CorralError as exc:
        typer.echo(f"Error: {exc.message}", err=True)
        if settings().debug:
            raise
        sys.exit(1)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except Exception as exc:
        # Usage errors come from the click that typer vendors; match them by shape.
        if hasattr(exc, "format_message"):
            typer.echo(f"Error: {exc.format_message()}", err=True)
            sys.exit(1)
        if settings().debug:
            raise
        typer.echo(f"Error: {exc}", err=True)
        sys.exit(1)

