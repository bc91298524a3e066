#!/usr/bin/env bash
# The GPU checks of one device-machine session, as one script (README "GPU"): the GPU tests (CUDA graphs
# against eager and HF, the engine's greedy tests and the sampler on CUDA, the kernels compiled; PARTS naming
# `tests-models`: the other model types on CUDA), `make bench-gpu`, `make bench-kernels`
# and (PARTS naming `sweep`) its --sweep, and (PARTS naming `served`) client/bench_served.py through
# tritonserver; PARTS chooses the parts. Each part has its own time limit, so one that hangs or fails
# leaves the others their time; logs and tables go to $OUT. Needs no package registry: a newer
# transformers travels as a wheel under .whl/, xgrammar and its imports under .whl-grammar/ (both from
# scripts/fetch_gpu_wheels.sh; installed to /tmp/site), the default model's tokenizer files under models/.
set -u
OUT=${OUT:-/tmp/inflight-gpu-session}
mkdir -p "$OUT"
if compgen -G ".whl*/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/backend PYTHONUNBUFFERED=1
part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 seconds=$2
  shift 2
  echo "== $name (limit ${seconds} s)"
  local started=$SECONDS
  timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - started)) s"
  grep -E "passed|failed|error" "$OUT/$name.log" | tail -3
}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
want() { [[ " ${PARTS:-tests-engine bench-gpu bench-kernels tests-kernels} " == *" $1 "* ]]; }
# (-m "not slow": those run the default model, whose weights the device does not have.)
# (-v: a run cut by its time limit still names what passed and what was running.)
# TESTS_K: a pytest -k expression choosing some of them, e.g. "on_a_gpu" (the graphs of steps with prompt
# chunks and of drafts against eager, and drafts beside graphs: what 2026-12-05 added, uncompiled before).
want tests-engine && part tests-engine "${TESTS_S:-120}" python3 -m pytest -v --durations=15 -p no:cacheprovider -m "not slow" \
  tests/test_cuda_graphs.py tests/test_engine_greedy.py tests/test_fused_layers.py tests/test_engine_behaviour.py \
  tests/test_async_scheduling.py tests/test_lora.py tests/test_beam_search.py tests/test_speculative.py \
  tests/test_prompt_embeds.py tests/test_images.py tests/test_sliding_window.py tests/test_draft_model.py \
  tests/test_chunked_attention.py tests/test_quantized.py tests/test_kv_offload.py \
  -k "${TESTS_K:-(cuda or graphs or auto or padded or bucket or step_inputs or gpu or pipeline) and not more_model_types}"
# The other model types (README "Models") on CUDA: their kernels' softcap and sinks compiled, and whether
# each captures in CUDA graphs (the warnings summary names those whose decode steps ran eagerly).
want tests-models && part tests-models "${MODELS_S:-240}" python3 -m pytest -q -p no:cacheprovider \
  tests/test_engine_greedy.py -k "more_model_types and cuda"
# BENCH_ARGS: bench-gpu's options beyond the GPU engine issue's set (what `make bench-gpu` runs, in the
# issue's five minutes), e.g. "--all --skip graphs,sampled,greedy,hf-cb,hf-static" for the other modes
# alone, "--offload --skip graphs,sampled,greedy,hf-cb,hf-static,arrivals" for the host tier alone. The log says how long each measurement took.
want bench-gpu && part bench-gpu "${BENCH_S:-300}" python3 client/bench_gpu.py --host-profile ${BENCH_ARGS:-} \
  --out "$OUT/bench-gpu.md"
want bench-kernels && part bench-kernels "${KERNELS_S:-90}" python3 client/bench_kernels.py
# SWEEP_ARGS: a part of the sweep, e.g. "--shapes smollm2 --mixes prefill" (bench_kernels.py --help).
want sweep && part sweep "${SWEEP_S:-300}" python3 client/bench_kernels.py --sweep ${SWEEP_ARGS:-}
# The served measurement (issue: serving on a GPU): tritonserver and perf_analyzer from the bundle of
# scripts/pack_tritonserver.sh, carried as .serving/.
if want served; then
  mkdir -p /tmp/tritonserver/stub-numpy /tmp/site .tools/perf && tar -C /tmp/tritonserver -xJf .serving/tritonserver.tar.xz \
    && tar -C /tmp/tritonserver/stub-numpy -xJf .serving/stub/numpy-1.26.4.tar.xz \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .serving/client/*.whl \
    && tar -C /tmp/site -xJf .serving/client/tritonclient-2.51.0.tar.xz \
    && tar -C .tools/perf -xJf .serving/perf.tar.xz  # (perf_analyzer: bench_served.py's C++ client)
  export PYTHONPATH=/tmp/site:$PYTHONPATH TRITONSERVER_HOME=/tmp/tritonserver
  libdir=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
  export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  LD_LIBRARY_PATH=/tmp/tritonserver/lib:$LD_LIBRARY_PATH ldd /tmp/tritonserver/backends/python/triton_python_backend_stub \
    | grep "not found" && echo "the stub cannot start here: a library above is missing"
  part served "${SERVED_S:-420}" python3 client/bench_served.py --out "$OUT/served.md" ${SERVED_ARGS:-}
  # Whatever a run cut short left (it stops its server on the time limit's SIGTERM; this is in case).
  pkill -KILL -f "$TRITONSERVER_HOME/(bin/tritonserver|backends/python/triton_python_backend_stub)" \
    && echo "killed a tritonserver left running"
fi
# KERNEL_TESTS_K: a pytest -k expression choosing some of them, e.g. "decode or split or merged or apart"
# (each kernel variant compiles the first time a test meets it: the whole file takes minutes).
want tests-kernels && part tests-kernels "${KERNEL_TESTS_S:-120}" python3 -m pytest -v --durations=10 -p no:cacheprovider \
  tests/test_kernels.py -k "${KERNEL_TESTS_K:-}"
# (Each part says its own exit in the log; the script ends 0, also when the last part is not wanted.)
exit 0
