"""The engine: one llama.cpp context's step, schedule -> run -> postprocess (`engine.py`),
which waiting sequence is placed on which slot and where its prefix comes from
(`placer.py`), the batch (`batchplan.py`), a job's admission (`admission.py`), pool mode's
cell accounting (`kvpool.py`), what a step does to a sequence's KV (`kvops.py`) and image
spans into the batch (`imagefeed.py`)."""
