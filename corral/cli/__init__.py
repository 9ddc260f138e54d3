"""The `corral` command line: typer commands, the chat REPL, rich progress and tables."""
