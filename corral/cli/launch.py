"""The `corral` entry point.

`corral run MODEL` with no daemon running starts one (preloading MODEL) before
the command-line toolkit is imported, so the daemon's start and the model's
load overlap the CLI's own start instead of following it.
"""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
    if len(argv) >= 2 and argv[0] == "run" and not argv[1].startswith("-"):
        from corral.api.autostart import spawn_early
        from corral.config import load_settings

        spawn_early(load_settings(warn=False), argv[1])  # the CLI warns once, later
    if argv and argv[0] == "run":
        # `--think` alone means true, `--think=high` a level, as in Ollama's CLI; the
        # option parser would take the next word (the prompt) as the value instead.
        sys.argv[1:] = ["--think=true" if a == "--think" else a for a in argv]
    from corral.cli.main import main as cli_main

    cli_main()
