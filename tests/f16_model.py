"""Test helper: an F16 copy of a starter, written with the `gguf` package.

Every quantized tensor is dequantized (`gguf.quants.dequantize`) and stored as F16;
one-dimensional tensors stay F32, as llama.cpp's converters write them. The metadata
is copied field by field, with `general.file_type` set to MOSTLY_F16, so the copy is a
source that `create --quantize` accepts and that loads and answers like the original.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from benchmarks.gpu_model import field_value  # also what the GPU check copies fields with

F16_FILE_TYPE = 1


def write_f16_copy(src: Path, dst: Path) -> Path:
    reader = gguf.GGUFReader(str(src))
    arch = str(field_value(reader.fields["general.architecture"])[0])
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        value, vtype, sub = field_value(field)
        writer.add_key_value(name, value, vtype, sub_type=sub)
    writer.add_file_type(F16_FILE_TYPE)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = list(reversed([int(d) for d in t.shape]))  # numpy order: rows last
        data = data.reshape(shape)
        out = data.astype(np.float32 if len(shape) == 1 else np.float16)
        writer.add_tensor(t.name, out)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def write_lora(base: Path, dst: Path, seed: int = 0, rank: int = 4, std: float = 0.08,
               targets: tuple[str, ...] = ("attn_q", "attn_v"), arch: str | None = None,
               wrong_rank: bool = False) -> Path:
    """A LoRA adapter GGUF for `base`'s attention tensors, random from a fixed seed.

    llama.cpp's layout: `<tensor>.lora_a` has ggml shape [n_in, rank] and
    `<tensor>.lora_b` [rank, n_out] for a base tensor of [n_in, n_out]. `arch` and
    `wrong_rank` make adapters that must be refused.
    """
    reader = gguf.GGUFReader(str(base))
    base_arch = str(field_value(reader.fields["general.architecture"])[0])
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(dst), arch or base_arch)
    writer.add_string(gguf.Keys.General.TYPE, "adapter")
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[2] not in targets or parts[3] != "weight":
            continue
        n_in, n_out = int(t.shape[0]), int(t.shape[1])  # ggml order
        a = rng.normal(0, std, (rank, n_in)).astype(np.float32)  # numpy: [rank][n_in]
        b = rng.normal(0, std, (n_out, rank + int(wrong_rank))).astype(np.float32)
        writer.add_tensor(t.name + ".lora_a", a)
        writer.add_tensor(t.name + ".lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
