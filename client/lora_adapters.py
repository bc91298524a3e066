"""Random LoRA adapters of a model, saved as peft saves any adapter: for the tests (outputs against
peft's model) and the benchmark (the cost of serving adapters)."""

from pathlib import Path

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
