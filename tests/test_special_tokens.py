"""Model files without the special tokens llama.cpp can do without: a GGUF with no EOS id,
no BOS id, or neither, loads and answers as llama.cpp itself answers on the same file
(the greedy decode of its own API, as llama-server's slot runs it). Every token id read
from a model can be absent (-1); none is asked for its text.

The files are tiny random llamas written here with a vocabulary of llama.cpp's RWKV
type, whose BOS and EOS default to none (src/llama-vocab.cpp), and the ids added one by
one. A runner that dies during its load reports its last words (stderr), not 'no ready
signal'."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import httpx
import pytest

from benchmarks.gpu_model import Dims, write_model
from corral.errors import RunnerError
from corral.registry.store import file_sha256
from corral.runner.client import RunnerProcess
from corral.runner.loadconfig import LoadConfig
from tests.support import DaemonFactory
from tests.test_infill import Vocab

N = 12
PROMPT = "Once upon a time"
VARIANTS = {"neither": (False, False), "bos-only": (True, False), "eos-only": (False, True),
            "both": (True, True)}


def write_vocab(path: Path, bos: bool, eos: bool) -> None:
    """Printable ASCII and a few words, as an RWKV-type vocabulary (a byte trie: any ASCII
    text tokenizes), with BOS and EOS ids only where asked."""
    words = [chr(c) for c in range(32, 127)] + ["\\n", " the", " a", "Once", " upon", " time"]
    tokens, types = ["<pad>", *words], [3] + [1] * len(words)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("rwkv")
    for wanted, text, add in ((bos, "<s>", w.add_bos_token_id),
                              (eos, "</s>", w.add_eos_token_id)):
        if wanted:
            add(len(tokens))
            tokens.append(text)
            types.append(3)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("special")
    made = {}
    for name, (bos, eos) in VARIANTS.items():
        write_vocab(root / f"{name}.vocab.gguf", bos, eos)
        made[name] = root / f"{name}.gguf"
        write_model(root / f"{name}.vocab.gguf", made[name], Dims(64, 2, 4, 2, 128, 512),
                    seed=5)
    return made


def reference(path: Path) -> tuple[str, int, int]:
    """llama.cpp's own greedy answer (ending at an end-of-generation token, as a slot
    does), and its BOS and EOS ids."""
    import llama_cpp as L

    v = Vocab(path)
    try:
        prompt = v.tok(PROMPT)
        if L.llama_vocab_get_add_bos(v.vocab):
            prompt = [L.llama_vocab_bos(v.vocab), *prompt]
        return (v.text(v.greedy(prompt, N)), L.llama_vocab_bos(v.vocab),
                L.llama_vocab_eos(v.vocab))
    finally:
        v.close()


@pytest.mark.model
def test_models_without_bos_or_eos_load_and_answer_as_llama_cpp(
        models: dict[str, Path], daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(None, NUM_PARALLEL="1", MAX_LOADED_MODELS="1")
    for name, (bos, eos) in VARIANTS.items():
        text, bos_id, eos_id = reference(models[name])
        assert (bos_id >= 0, eos_id >= 0) == (bos, eos), name  # llama.cpp agrees it has none
        digest = file_sha256(models[name])
        upload = httpx.post(f"{d.url}/api/blobs/{digest}", content=models[name].read_bytes(),
                            timeout=60)
        assert upload.status_code == 201
        created = httpx.post(f"{d.url}/api/create", timeout=300, json={
            "model": name, "files": {f"{name}.gguf": digest}, "stream": False})
        assert created.status_code == 200, created.text
        r = httpx.post(f"{d.url}/api/generate", timeout=300, json={
            "model": name, "prompt": PROMPT, "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": N}})
        assert r.status_code == 200, (name, r.text)
        assert r.json()["response"] == text, name
        chat = httpx.post(f"{d.url}/api/chat", timeout=300, json={
            "model": name, "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": {"temperature": 0, "num_predict": 4}})
        assert chat.status_code == 200, (name, chat.text)


LAST_WORDS = '''#!{python}
import os, sys
print("llama_model_load: a line before the end", file=sys.stderr)
print("GGML_ASSERT(n_tokens > 0) failed", file=sys.stderr, flush=True)
os.abort()
'''


def test_a_runner_that_dies_loading_reports_its_last_words(tmp_path: Path) -> None:
    script = tmp_path / "runner"
    script.write_text(LAST_WORDS.format(python=sys.executable))
    script.chmod(0o755)
    runner = RunnerProcess(LoadConfig(model=str(tmp_path / "x.gguf")), python=str(script))
    with pytest.raises(RunnerError) as failed:
        runner.start(timeout=60)
    assert "GGML_ASSERT(n_tokens > 0) failed" in failed.value.message
    assert "exit status" in failed.value.message
