#!/usr/bin/env bash
# One prepared GPU check, for a lent CUDA machine with no network (about 10 minutes).
#
# Here (with network):   benchmarks/gpu_check.sh prepare
#   writes benchmarks/.gpu/: the llama.cpp sources repacked from the pinned sdist
#   (vocab models and tests dropped, under 64 MiB), wheels for Corral and every
#   dependency, and both starter GGUFs.
# There (the GPU machine, from the repository root):   benchmarks/gpu_check.sh run
#   builds llama.cpp once with CUDA for the detected architecture (the shared
#   libraries, llama-server and llama-batched-bench), installs Corral from the
#   wheels with LLAMA_CPP_LIB_PATH pointing at the built libraries, then runs
#   benchmarks/gpu_check.py, which writes one JSON file and one markdown table
#   under $OUT (or benchmarks/.gpu/out).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREP="$REPO/benchmarks/.gpu"
VERSION="$(grep -o 'llama-cpp-python==[0-9.]*' "$REPO/pyproject.toml" | cut -d= -f3)"
PY="${PYTHON:-python3}"
say() { printf '==> %s\n' "$*"; }

prepare() {
  mkdir -p "$PREP/wheels" "$PREP/models"
  local work; work="$(mktemp -d)"
  trap 'rm -rf "$work"' RETURN
  say "repacking the llama.cpp sources of llama-cpp-python $VERSION"
  "$PY" -m pip download --quiet --no-deps --no-binary=:all: "llama-cpp-python==$VERSION" -d "$work"
  tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  local src; src="$(echo "$work"/llama_cpp_python-*)"
  # The build needs the C/C++ sources and CMake files; not the vocab models, tests,
  # examples, docs or the web UI's assets.
  tar -czf "$PREP/llama-src.tar.gz" -C "$src" \
    --exclude='vendor/llama.cpp/models' --exclude='vendor/llama.cpp/tests' \
    --exclude='vendor/llama.cpp/docs' --exclude='vendor/llama.cpp/media' \
    --exclude='vendor/llama.cpp/examples/*/assets' --exclude='vendor/llama.cpp/tools/server/public*' \
    --exclude='vendor/llama.cpp/tools/server/webui' --exclude='.git*' .
  say "wheels for Corral and its dependencies (the llama-cpp-python wheel is built there)"
  "$PY" -m pip wheel --quiet --no-deps -w "$PREP/wheels" "$REPO"
  # Corral's dependencies and llama-cpp-python's Python ones; llama-cpp-python itself
  # is not built here: its Python sources travel with the repacked tree.
  "$PY" -m pip wheel --quiet -w "$PREP/wheels" httpx rich typer platformdirs jinja2 gguf \
    numpy diskcache "typing-extensions>=4.5" uvicorn starlette
  say "the starter GGUFs"
  "$PY" - "$PREP/models" <<'PY'
import shutil, sys
from corral.config import load_settings
from registry.starter import CHAT_NAME, STARTER_NAME, starter_model_path
from registry.store import Store
store = Store(load_settings().models)
for name in (CHAT_NAME, STARTER_NAME):
    path = starter_model_path(store, name)
    if path is None:
        raise SystemExit(f"Error: {name} is not installed; run ./install.sh first")
    shutil.copy(path, f"{sys.argv[1]}/{name.replace(':', '-')}.gguf")
PY
  du -sh "$PREP"
}

run() {
  local out="${OUT:-$PREP/out}" build="$PREP/build" started=$SECONDS
  mkdir -p "$out" "$build"
  local arch; arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' .')"
  say "building llama.cpp with CUDA for sm_$arch"
  mkdir -p "$build/src" && tar -xzf "$PREP/llama-src.tar.gz" -C "$build/src"
  cmake -S "$build/src/vendor/llama.cpp" -B "$build/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_NATIVE=OFF -DGGML_RPC=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=ON > "$out/cmake.log" 2>&1
  cmake --build "$build/cmake" --target llama ggml mtmd llama-server llama-batched-bench \
    -j "$(nproc)" >> "$out/cmake.log" 2>&1
  local build_seconds=$((SECONDS - started))
  say "built in ${build_seconds} s; installing Corral from the prepared wheels"
  "$PY" -m venv "$build/venv"
  # llama-cpp-python's Python package, without compiling it a second time: its
  # sources, pointed at the libraries just built.
  mkdir -p "$build/pkg" && cp -r "$build/src/llama_cpp" "$build/pkg/"
  "$build/venv/bin/pip" install --quiet --no-index --find-links "$PREP/wheels" --no-deps \
    "$PREP"/wheels/*.whl
  local libdir; libdir="$(dirname "$(find "$build/cmake" -name 'libllama.so' | head -n1)")"
  export LLAMA_CPP_LIB_PATH="$libdir" PYTHONPATH="$build/pkg" LD_LIBRARY_PATH="$libdir"
  "$build/venv/bin/python" "$REPO/benchmarks/gpu_check.py" --models "$PREP/models" \
    --bin "$(dirname "$(find "$build/cmake" -name llama-server -type f | head -n1)")" \
    --out "$out" --build-seconds "$build_seconds"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 1 ;;
esac
