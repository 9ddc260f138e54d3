"""What runs in a child process of its own, so that a crash in native code ends the
child: quantizing (`quantize.py`), a projector's trial load (`probe.py`), llama.cpp's RPC
worker (`rpc.py`) and the install-time smoke check (`smoke.py`)."""
