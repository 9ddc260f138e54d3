"""The runner layer: one model served by llama.cpp in a process of its own.

Its top holds the contract with the daemon, which the daemon imports without
llama.cpp: the wire records (`wire.py`, `rankwire.py`, `fim.py`), the client that
starts and talks to a runner (`client.py`), the load configuration (`loadconfig.py`)
and the fit estimate (`fitestimate.py`, with `nvml.py`); and the types the folders
share (`jobs.py`, `prefix.py`). Nothing there imports a folder.

What runs in the process is in folders, each importing only those below it:
`llama/` (bindings and features) <- `slots/` <- `kv/` (KV memory) <- `cache/` (the
prompt cache) <- `engine/` <- `process/`, and `tools/` (child processes, over `llama/`).
"""
