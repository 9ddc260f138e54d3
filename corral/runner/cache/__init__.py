"""The prompt cache: KV kept after a sequence leaves its slot, in RAM (`promptcache.py`)
and on disk (`diskcache.py`, read off the engine thread by `diskread.py`), behind one
lookup (`caches.py`)."""
