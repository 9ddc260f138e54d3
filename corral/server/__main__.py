"""`python -m corral.server [--preload MODEL]`: the daemon without the CLI around it.

The CLI starts the daemon this way when none is running: it skips loading the
command-line toolkit, and `--preload` lets the runner for the model that
`corral run` asked for start loading while the CLI waits for the port.
"""

from __future__ import annotations

import sys

from corral.config import load_settings
from corral.errors import CorralError
from corral.server.daemon import run


USAGE = """usage: python -m corral.server [--preload MODEL]

Runs the Corral daemon in the foreground (settings from CORRAL_* variables, see
`corral serve --help`). --preload starts loading MODEL's runner at once."""


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0
    preload = argv[argv.index("--preload") + 1] if "--preload" in argv[:-1] else None
    try:
        run(load_settings(), preload)
    except CorralError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
