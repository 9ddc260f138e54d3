"""The llama.cpp engine (slots, batching, sampling, templates), runner process, scheduler."""
