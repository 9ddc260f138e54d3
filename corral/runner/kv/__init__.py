"""KV memory: a sequence's KV as bytes between contexts (`kvbytes.py`), elastic KV
(`growth.py`) and the cap's context made ahead (`reserve.py`)."""
