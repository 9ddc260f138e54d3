"""`corral` commands. Every failure prints `Error: <message>` and exits 1."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

import typer

from api.config import Settings, describe_settings, load_settings
from api.errors import CorralError
from cli import tables
from registry.store import Store

EXAMPLES = """
Examples:

  corral run gemma3:270m-base            chat with the starter model
  corral run gemma3:270m-base "Hi"       one answer, then exit
  corral list                            models in the store
"""

app = typer.Typer(
    help="Corral runs local models behind an Ollama-compatible API." + EXAMPLES,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def corral_version() -> str:
    try:
        return version("corral")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"corral version {corral_version()}")
        raise typer.Exit()


class _State:
    settings: Optional[Settings] = None


def settings() -> Settings:
    if _State.settings is None:
        _State.settings = load_settings()
    return _State.settings


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", "-v", callback=_version, is_eager=True, help="Show the version."
    ),
) -> None:
    """Corral: local models, an Ollama-compatible API, continuous batching."""


@app.command("list")
def list_models() -> None:
    """List models in the store."""
    entries = Store(settings().models).list_models()
    tables.print_models(entries)


app.command("ls", hidden=True)(list_models)


@app.command(epilog=describe_settings())
def serve() -> None:
    """Start the daemon (Ollama-compatible API on CORRAL_HOST)."""
    from api.daemon import Daemon, configure_logging

    cfg = settings()
    configure_logging(cfg.debug)
    try:
        daemon = Daemon(cfg, runner_log=sys.stderr.buffer)
    except OSError as exc:
        raise CorralError(f"could not listen on {cfg.host}: {exc.strerror or exc}") from None
    daemon.prune()
    daemon.serve_forever()


def main() -> None:
    try:
        app(standalone_mode=False)
    except CorralError as exc:
        typer.echo(f"Error: {exc.message}", err=True)
        if settings().debug:
            raise
        sys.exit(1)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
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
