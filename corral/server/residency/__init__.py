"""Model residency, below the request pipeline: which models are loaded, in which runner
process, with how many slots (`scheduler`, its health watch included, over the per-model
records of `resident`), whether another fits (`fit`), each runner's share of the cores
(`threads`), and the calls to runners that nobody waits for (`courier`). It imports
nothing else of the server: no chat domain, no pipeline, no HTTP."""
