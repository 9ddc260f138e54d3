"""llama.cpp's bindings and what is built on them: the C API (`capi.py`, `native.py`), one
model and its context (`context.py`), sampling and streamed text (`sampling.py`,
`textstream.py`), vision (`vision.py`), embeddings (`embedding.py`) and the rerank prompt
(`rerank.py`)."""
