"""`python -m cli` is `corral`; the background daemon is started this way."""

from cli.main import main

main()
