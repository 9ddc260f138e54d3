"""`python -m corral.cli` is `corral`."""

from corral.cli.launch import main

main()
