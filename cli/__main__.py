"""`python -m cli` is `corral`."""

from cli.launch import main

main()
