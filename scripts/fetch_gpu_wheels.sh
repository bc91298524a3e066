#!/usr/bin/env bash
# Wheels for the lent GPU machine (Python 3.12, no package registry), at the versions requirements.txt
# pins: transformers, and peft with accelerate (LoRA), into .whl/ (carried on every call), xgrammar and what it imports into .whl-grammar/
# (carried when the call runs the grammar tests; with compressed-tensors, which imports pydantic too, for
# test_quantized.py's compressed-tensors formats), pillow into .whl-images/ (7 MB: carried when the call
# runs test_images.py; with .serving/, .whl/ and the tokenizer it would pass the 64 MiB a call may carry).
# scripts/gpu_session.sh installs whatever of them is there.
set -euo pipefail
cd "$(dirname "$0")/.."
pin() { grep -i "^$1==" requirements.txt; }
fetch() {  # fetch FOLDER REQUIREMENT...
  local folder=$1
  shift
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$folder" "$@"
}
fetch .whl "$(pin transformers)" "$(pin peft)" "$(pin accelerate)"
fetch .whl-grammar "$(pin xgrammar)" "$(pin apache-tvm-ffi)" "$(pin pydantic)" "$(pin pydantic_core)" \
  "$(pin annotated-types)" "$(pin typing-inspection)" "$(pin typing_extensions)" "$(pin compressed-tensors)" \
  "$(pin loguru)"
fetch .whl-images "$(pin pillow)"
du -sh .whl .whl-grammar .whl-images
