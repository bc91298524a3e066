#!/usr/bin/env bash
# What serving needs on a machine that reaches no package registry (a lent GPU machine), packed under
# .serving/ (ignored by git; carry it): tritonserver 2.51 from the nvidia-pytriton wheel with its Python
# backend and the stub for one Python version, only the shared libraries those load (about 105 MB
# unpacked, xz-compressed), numpy 1.26 for the stub (its wheel's files, xz-compressed: 9 MB, the wheel
# 18), the wheels of the gRPC client, and perf_analyzer 2.51 with the libraries it links that a machine
# may lack (libb64, the CUDA 12 runtime). There:
#   mkdir -p /tmp/tritonserver/stub-numpy && tar -C /tmp/tritonserver -xJf .serving/tritonserver.tar.xz
#   tar -C /tmp/tritonserver/stub-numpy -xJf .serving/stub/numpy-1.26.4.tar.xz
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .serving/client/*.whl
#   tar -C /tmp/site -xJf .serving/client/tritonclient-2.51.0.tar.xz
#   mkdir -p .tools/perf && tar -C .tools/perf -xJf .serving/perf.tar.xz
#   TRITONSERVER_HOME=/tmp/tritonserver PYTHONPATH=/tmp/site python3 client/bench_served.py
# (scripts/gpu_session.sh does this.) The stub links the system's libpython of that version.
#   bash scripts/pack_tritonserver.sh [PYTHON_VERSION, default 3.12] [OUTPUT FOLDER, default .serving]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYV=${1:-3.12}
bash scripts/setup.sh --serving >/dev/null
SRC=.tools/pytriton/pytriton/tritonserver
LIBS=.tools/pytriton/nvidia_pytriton.libs
OUT=${2:-.serving}
rm -rf "$OUT" && mkdir -p "$OUT/stub" "$OUT/client"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/backends/python" "$stage/lib"
cp "$SRC/bin/tritonserver" "$stage/bin/"
cp "$SRC/backends/python/libtriton_python.so" "$SRC/backends/python/triton_python_backend_utils.py" \
   "$stage/backends/python/"
cp "$SRC/python_backend_stubs/$PYV/triton_python_backend_stub" "$stage/backends/python/"
# The wheel's libraries that these load (directly or through each other), and no others.
for binary in "$stage/bin/tritonserver" "$stage/backends/python/libtriton_python.so" \
              "$stage/backends/python/triton_python_backend_stub"; do
  LD_LIBRARY_PATH=$LIBS ldd "$binary" | awk '$3 ~ /nvidia_pytriton.libs/ {print $3}'
done | sort -u | xargs -I{} cp {} "$stage/lib/"
tar -C "$stage" -cf - . | xz -9 -T2 >"$OUT/tritonserver.tar.xz"
wheels=(--no-deps --only-binary=:all: --python-version "$PYV" --implementation cp
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
        --platform manylinux_2_24_x86_64)
# numpy for the stub: its wheel unzipped is numpy installed (the stub needs none of its scripts).
.venv/bin/python -m pip download -q "${wheels[@]}" -d "$stage/numpy" numpy==1.26.4
(cd "$stage/numpy" && "$ROOT/.venv/bin/python" -m zipfile -e numpy-1.26.4-*.whl files)
tar -C "$stage/numpy/files" -cf - . | xz -9 -T2 >"$OUT/stub/numpy-1.26.4.tar.xz"
# perf_analyzer as the setup installed it, and the two libraries it links beside the system's.
mkdir -p "$stage/perf/bin" "$stage/perf/lib"
cp .tools/perf/bin/perf_analyzer "$stage/perf/bin/"
cp .tools/perf/cuda/nvidia/cuda_runtime/lib/libcudart.so.12 "$stage/perf/lib/"
cp "$(ldconfig -p | awk '/libb64\.so\.0d/ {print $NF; exit}')" "$stage/perf/lib/"
tar -C "$stage/perf" -cf - . | xz -9 -T2 >"$OUT/perf.tar.xz"
# The gRPC client of the server's own release, its Python alone (its wheel also holds 40 MB of
# perf_analyzer): newer clients' generated code needs newer grpcio and protobuf than a machine may have.
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 -d "$stage" \
  tritonclient==2.51.0
(cd "$stage" && "$ROOT/.venv/bin/python" -m zipfile -e tritonclient-2.51.0-*.whl client)
tar -C "$stage/client/tritonclient-2.51.0.data/purelib" -cJf "$OUT/client/tritonclient-2.51.0.tar.xz" tritonclient
.venv/bin/python -m pip download -q "${wheels[@]}" -d "$OUT/client" "$(grep -i '^python-rapidjson==' requirements.txt)"
du -sh "$OUT"/* | sed 's/^/[pack] /'
