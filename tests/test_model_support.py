"""Models the engine cannot run exactly are refused at start-up, each with its reason (model_support.py);
the model types it runs are tested against HF in test_engine_greedy.py (MORE_FAMILIES)."""

import pytest
import torch

from conftest import DEFAULT_MODEL
from inflight import LLM
from inflight.attention import AttentionCall
from inflight.model_support import UnsupportedModel, check_attention_calls

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=1024, initializer_range=0.2, eos_token_id=2, bos_token_id=1, pad_token_id=0)

# model type: (its settings beyond SMALL, what the refusal says)
REFUSED = {
    "qwen3_next": (dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4),
                   "layers of type linear_attention, which keep a state per sequence"),
    "falcon_h1": (dict(num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                       mamba_n_groups=1), "layers of type hybrid"),
    "lfm2": (dict(num_key_value_heads=2, full_attn_idxs=[1]), "layers of type conv"),
    "gemma3_text": (dict(num_key_value_heads=2, head_dim=16, use_bidirectional_attention=True),
                    "its attention is bidirectional"),
    "falcon": (dict(), "does not use transformers' attention interface"),
    "bloom": (dict(n_embed=64, n_layer=2, n_head=4), "its attention does not go through transformers' attention "
                                                    "interface"),
    "deepseek_v3": (dict(num_key_value_heads=4, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=32,
                         qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=8),
                    "layer 0 has query, key and value heads of sizes 32, 32 and 8"),
    "nemotron": (dict(num_key_value_heads=2), "attention was called without the engine's inflight_context"),
}


def make_checkpoint(model_type: str, out, **settings) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.for_model(model_type, **{**SMALL, **settings})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("model_type", REFUSED)
def test_models_the_engine_cannot_run_are_refused_at_start_up(model_type, tmp_path):
    """Hybrid layers with a state per sequence, bidirectional attention, modeling code without transformers'
    attention interface or that drops its arguments, heads of two sizes (MLA): each refused with the reason,
    never a wrong answer or a failure in a request."""
    settings, reason = REFUSED[model_type]
    model = make_checkpoint(model_type, tmp_path / model_type, **settings)
    with pytest.raises(UnsupportedModel, match=f"model type '{model_type}'") as refused:
        LLM(model, device="cpu", dtype="float32", num_kv_blocks=16)
    assert reason in str(refused.value)


def test_a_vision_language_model_whose_images_are_not_served_is_refused_by_name(tmp_path):
    """Qwen2.5-VL (3-D positions for its images; transformers has no causal LM of it alone): refused with the
    reason and the vision-language types served, not transformers' list of every model type."""
    from transformers import Qwen2_5_VLConfig

    vision = dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2)
    Qwen2_5_VLConfig(text_config={**SMALL, "num_key_value_heads": 2}, vision_config=vision).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="model type 'qwen2_5_vl': transformers has no causal language model "
                                               "for it; inflight serves vision-language models of the types llava"):
        LLM(str(tmp_path), device="cpu", num_kv_blocks=16)


def test_chunked_attention_runs_over_one_chunk_unless_set(tmp_path):
    """Llama 4's chunked attention: the engine's context limit is the chunk unless set (within it, the
    layers read every sequence as full attention does); set longer, the chunked layers read each sequence
    from its chunk's start (test_chunked_attention.py), which needs a chunk of whole blocks."""
    model = make_checkpoint("llama4_text", tmp_path / "llama4", num_key_value_heads=2, head_dim=16,
                            attention_chunk_size=64)
    settings = dict(device="cpu", dtype="float32", num_kv_blocks=32)
    assert LLM(model, **settings).runner.max_model_len == 64
    assert LLM(model, **settings, max_model_len=48).runner.chunk_view is None
    runner = LLM(model, **settings, max_model_len=128).runner
    assert (runner.max_model_len, runner.chunk_view, runner.chunked_layers) == (128, 64, [True, True])
    with pytest.raises(UnsupportedModel, match=r"attention chunk \(64\), which is not a multiple of block_size "
                                               r"\(128\)"):
        LLM(model, **settings, max_model_len=128, block_size=128)


def calls(**arguments) -> list[AttentionCall]:
    """What a model of two layers (2 KV heads of 16 under 4 query heads) passes to attention."""
    return [AttentionCall(i, (1, 4, 2, 16), (1, 2, 2, 16), (1, 2, 2, 16), dict(arguments)) for i in range(2)]


def test_attention_calls_are_checked():
    check = lambda recorded: check_attention_calls(recorded, "tiny", 2, 2, 16)  # noqa: E731
    check(calls(position_ids=torch.zeros(2), use_cache=False, sliding_window=8, softcap=30.0,
                s_aux=torch.zeros(4), is_causal=True))
    refusals = {
        "attention_mask to attention": calls(attention_mask=torch.zeros(1, 1, 2, 2)),
        "alibi to attention": calls(alibi=torch.zeros(4)),
        "is not causal": calls(is_causal=False),
        "in layers [0]": calls()[:1],
        "in layers [0, 0, 1]": calls()[:1] + calls(),
        "does not go through": [],
        "4 KV heads of size 16 where its config says 2": [
            AttentionCall(i, (1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16)) for i in range(2)],
    }
    for reason, recorded in refusals.items():
        with pytest.raises(UnsupportedModel, match="model type 'tiny'") as refused:
            check(recorded)
        assert reason in str(refused.value)
