# inflight on a GPU machine: NVIDIA's Triton image (24.10 = tritonserver 2.51, Python 3.10) plus
# CUDA torch, the triton compiler torch pins, transformers, xgrammar and peft (LoRA adapters).
#
#   docker build -t inflight .
#   docker run --gpus all --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#       -v /path/to/hf-model-dir:/models/llm inflight
#
# The model folder (any Llama-family Hugging Face checkpoint: config.json, safetensors, tokenizer)
# is mounted at /models/llm; docker/model.json holds the GPU engine settings (INFLIGHT_MODEL_JSON).
FROM nvcr.io/nvidia/tritonserver:24.10-py3

RUN python3 -m pip install --no-cache-dir \
        torch==2.13.0 transformers==5.18.0 xgrammar==0.2.9 peft==0.21.2 safetensors accelerate psutil tqdm \
    && python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

WORKDIR /opt/inflight
COPY pyproject.toml README.md ./
COPY backend ./backend
COPY model_repository ./model_repository
COPY docker/model.json ./docker/model.json
RUN python3 -m pip install --no-cache-dir --no-deps .

ENV INFLIGHT_ROOT=/opt/inflight \
    INFLIGHT_MODEL=/models/llm \
    INFLIGHT_MODEL_JSON=/opt/inflight/docker/model.json \
    INFLIGHT_PYTHON=/usr/bin/python3
EXPOSE 8000 8001 8002
# Explicit model control: a model whose engine stopped unloads itself and reports not-ready. config.pbtxt
# is complete: no stub started only to ask model.py to complete it (scripts/serve.py does the same).
CMD ["tritonserver", "--model-repository=/opt/inflight/model_repository", "--allow-gpu-metrics=true", \
     "--model-control-mode=explicit", "--load-model=*", "--disable-auto-complete-config"]
