"""Slots and sequences: a slot is one KV stream (`slot.py`), a sequence one request's
progress (`sequence.py`), which moves between slots whole."""
