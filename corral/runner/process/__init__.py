"""The runner process (`python -m corral.runner`): its HTTP face and lifetime
(`main.py`), wire requests into engine jobs (`service.py`) and the model load started
before the heavier modules are imported (`loading.py`)."""
