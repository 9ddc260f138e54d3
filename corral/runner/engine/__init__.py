"""The engine: one llama.cpp context's step, schedule -> run -> postprocess (`engine.py`: the
loop), whose plan is data (`plan.py`): schedule decides it without llama.cpp
(`schedule.py`), with which waiting sequence is placed on which slot and where its prefix
comes from (`placer.py`), the KV ops that put it there (`kvplan.py`), the batch
(`batchplan.py`), a job's admission (`admission.py`), pool mode's cell accounting
(`kvpool.py`) and image slices (`imagefeed.py`); run makes every native call (`run.py`,
the KV ops in `kvops.py`); postprocess samples and streams (`postprocess.py`)."""
