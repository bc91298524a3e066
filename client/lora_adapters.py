"""Random LoRA adapters of a model, saved as peft saves any adapter: for the tests (outputs against
peft's model) and the benchmark (the cost of serving adapters); and any peft adapter in TensorRT-LLM's
format, as a request's lora_weights and lora_config (grpc_stream.py --lora-dir sends them)."""

import math
import re
from pathlib import Path

import numpy as np
import torch


def make_lora_adapter(model_dir: str, out: Path, seed: int, **lora_config) -> str:
    """A peft LoRA adapter of `model_dir` with random A and B (peft's init_lora_weights=False), so that
    it changes the model's outputs; saved as peft saves any adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_config)).save_pretrained(out)
    return str(out)


# Two adapters unlike each other: ranks, layers, rsLoRA's scaling, a layer's own alpha (alpha_pattern).
LORA_ADAPTERS = {
    "alpha": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], alpha_pattern={"v_proj": 40}),
    "beta": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"]),
}


def make_lora_adapters(model_dir: str, out: Path) -> dict[str, str]:
    """LORA_ADAPTERS for `model_dir`, as lora_modules: name -> folder."""
    return {name: make_lora_adapter(model_dir, out / name, seed, **config)
            for seed, (name, config) in enumerate(LORA_ADAPTERS.items(), start=1)}


# TensorRT-LLM's module ids (lora_tasks.py) of a Hugging Face model's projections.
TRTLLM_MODULE_IDS = {"qkv_proj": 0, "q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6,
                     "up_proj": 7}


def trtllm_lora_tensors(adapter_dir: str, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """A peft LoRA adapter as TensorRT-LLM's request inputs (lora_weights [rows, width], lora_config
    [rows, 3]): a row per adapted projection and layer, A [r, in] then B [out, r] scaled by the adapter's
    alpha / r (or / sqrt(r) with rsLoRA), padded with zeros to the longest row. A fused gate_up_proj
    gives two rows, its gate's and its up's (B's halves), with the same A."""
    from peft import PeftConfig
    from peft.utils import load_peft_weights
    from peft.utils.other import get_pattern_key

    config = PeftConfig.from_pretrained(adapter_dir)
    weights = load_peft_weights(adapter_dir, device="cpu")
    rows, configs = [], []
    for key in sorted(k for k in weights if ".lora_A." in k):
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        layer, projection = int(re.search(r"layers\.(\d+)\.", module)[1]), module.rsplit(".", 1)[1]
        a, b = weights[key].float(), weights[key.replace(".lora_A.", ".lora_B.")].float()
        rank = a.shape[0]
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
        b = b * (alpha / math.sqrt(rank) if config.use_rslora else alpha / rank)
        halves = {"gate_proj": b[:len(b) // 2], "up_proj": b[len(b) // 2:]} if projection == "gate_up_proj" \
            else {projection: b}
        for name, part in halves.items():
            rows.append(torch.cat([a.flatten(), part.flatten()]))
            configs.append([TRTLLM_MODULE_IDS[name], layer, rank])
    width = max(len(row) for row in rows)
    padded = torch.stack([torch.nn.functional.pad(row, (0, width - len(row))) for row in rows])
    return padded.numpy().astype(dtype), np.array(configs, dtype=np.int32)
