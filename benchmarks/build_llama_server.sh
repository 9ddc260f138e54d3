#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench from the sources vendored in the pinned
# llama-cpp-python sdist, with the CPU flags install.sh would use. Cached by version and flags.
#   benchmarks/build_llama_server.sh   -> prints the directory holding the binaries
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="$(grep -o 'llama-cpp-python==[0-9.]*' "$REPO/pyproject.toml" | cut -d= -f3)"
FLAGS="${CMAKE_ARGS:-$("$REPO/install.sh" --print-flags | tail -n1)}"
PY="${PYTHON:-python3}"
KEY="$(printf '%s|%s|%s' "$VERSION" "$FLAGS" "$(uname -sm)" | "$PY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/corral/llama-server/$KEY"
if [ -x "$CACHE/llama-server" ] && [ -x "$CACHE/llama-bench" ]; then echo "$CACHE"; exit 0; fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download --quiet --no-deps --no-binary=:all: "llama-cpp-python==$VERSION" -d "$WORK" >&2
tar -xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
SRC="$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)"
# shellcheck disable=SC2086
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON $FLAGS >&2
cmake --build "$WORK/build" --target llama-server llama-bench -j "$(nproc 2>/dev/null || echo 2)" >&2
mkdir -p "$CACHE"
cp "$WORK"/build/bin/llama-server "$WORK"/build/bin/llama-bench "$CACHE"/
cp "$WORK"/build/bin/*.so* "$CACHE"/ 2>/dev/null || true
echo "$CACHE"
