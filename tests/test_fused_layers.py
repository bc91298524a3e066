"""Fused layers (fused_layers.py): the norms, rotary embedding and SiLU-and-multiply of transformers'
Llama-family modules as compiled functions, or on a CPU in float32 as C kernels (ops/cpu_layer_ops.c).
On by default on a GPU and, in float32, on a CPU; the compiled functions are tested here on CPU too,
where inductor compiles them to C++."""

from collections import Counter

import pytest
import torch
from conftest import random_prompts
from test_engine_greedy import DEVICES, assert_nothing_compiles_after_start_up, run_and_compare

from inflight import LLM, SamplingParams, fused_layers
from inflight.config import EngineConfig
from inflight.fused_layers import _merged_mlp_forward, _mlp_forward, _norm_forward
from inflight.ops import cpu_kernels

# On a CPU: the C kernels (the default in float32) or the compiled functions; on a GPU, compiled.
WAYS = [("cpu", "c-kernels"), ("cpu", "compiled")] + [("cuda", "compiled")] * ("cuda" in DEVICES)


def require_c_kernels() -> cpu_kernels.LayerOps:
    """The CI machines have a C compiler: the layer kernels must build there (a silent fall-back to
    transformers' layers would pass every equality test and lose the speed); a GPU machine's image may
    have none."""
    ops = cpu_kernels.layer_ops()
    if ops is None and "cuda" in DEVICES:
        pytest.skip("no C compiler on this GPU machine")
    assert ops is not None, "the C layer kernels did not build"
    return ops


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """Fused layers built from here on compile their functions on a CPU too, as where no C compiler is."""
    monkeypatch.setattr(fused_layers, "_cpu_kernels", {})  # (those an earlier engine loaded)
    monkeypatch.setattr(cpu_kernels, "layer_ops", lambda: None)


@pytest.mark.parametrize("device,functions", WAYS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_layers_match_hf(tiny_models, hf_reference, family, device, functions, request):
    """Greedy output with the fused functions equals HF's, token for token, through chunked prefill and
    decodes of every batch size (on a GPU, in CUDA graphs too); each norm and MLP runs the fused function,
    and each layer's query, key and value projections and its gate and up projections are one matmul (on
    a CPU, with the linear layers unpacked: packed ones are not merged)."""
    if functions == "compiled" and device == "cpu":
        request.getfixturevalue("compiled_on_cpu")
    elif functions == "c-kernels":
        require_c_kernels()
    prompts = random_prompts(8, 1, 120, vocab=512, seed=17)
    llm = run_and_compare(tiny_models[family], prompts, hf_reference, device=device, dtype="float32",
                          fused_layers=True, packed_weights=False, num_kv_blocks=128, max_num_seqs=8,
                          max_num_batched_tokens=64)
    fused = llm.runner.fused_layers
    assert fused.compiles == (functions == "compiled")
    layers = llm.runner.num_layers
    # Qwen3 normalizes queries and keys per head besides the two norms a layer and the final one.
    assert fused.norms == (4 if family == "qwen3" else 2) * layers + 1
    assert fused.mlps == layers and fused.merged == 2 * layers
    model = llm.runner.model.model
    assert model.norm.forward.__func__ is _norm_forward and model.layers[0].mlp.forward.__func__ is _merged_mlp_forward
    attention = model.layers[0].self_attn
    storage = attention.q_proj.weight.untyped_storage().data_ptr()
    assert attention.k_proj.weight.untyped_storage().data_ptr() == storage, "q and k weights were meant to be merged"
    assert fused.layers == layers and model.layers[0].mlp.inflight_accumulates
    if device == "cpu":
        # A forward is 4 matmuls a layer (queries-keys-values, out, gate-up, and down adding into the
        # residual stream) and the head; no residual add of its own.
        from torch.profiler import profile

        with profile() as prof:
            llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        ops = Counter(event.name for event in prof.events())
        assert (ops["aten::linear"], ops["aten::addmm_"]) == (2 * (3 * layers + 1), 2 * layers), ops  # two forwards
        assert ops["aten::add"] == 0, ops


def test_packed_linear_layers_keep_their_packed_forward(tiny_models, hf_reference):
    """On a CPU with packed weights (the default) the projections keep their packed forward (the packing
    merged them, fused layers do not), and the MLP's residual add runs after its down projection: HF's
    output still."""
    llm = run_and_compare(tiny_models["llama"], random_prompts(4, 1, 60, vocab=512, seed=5), hf_reference,
                          device="cpu", dtype="float32", fused_layers=True, num_kv_blocks=32, max_num_seqs=4,
                          max_num_batched_tokens=32)
    assert llm.runner.fused_layers.merged == 0 and llm.runner.fused_layers.layers == llm.runner.num_layers
    mlp = llm.runner.model.model.layers[0].mlp
    assert mlp.forward.__func__ is _mlp_forward and not mlp.inflight_accumulates
    assert mlp.gate_proj.forward.func.__self__ is mlp.up_proj.forward.func.__self__  # one packed matmul


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_layers_compile_at_start_up(tiny_models, family, compiled_on_cpu):
    """No request waits for a compile: start-up compiles each function for the token counts a step can
    have (with the projections merged, as on a GPU: the functions then read slices of their output)."""
    llm = LLM(tiny_models[family], device="cpu", dtype="float32", fused_layers=True, packed_weights=False,
              num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=False)
    assert llm.runner.fused_layers.merged == 2 * llm.runner.num_layers
    assert_nothing_compiles_after_start_up(llm)


def test_fused_rotary_embedding_only_inside_the_engines_forward(tiny_models):
    """The modeling module's rotary embedding is swapped only while the engine's forward runs: another
    model of the same family in the process runs transformers' own code."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", fused_layers=True, num_kv_blocks=32,
              max_num_seqs=2, max_num_batched_tokens=32)
    seen = []
    llm.runner.model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(modeling_llama.apply_rotary_pos_emb))
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert seen and all(f is not original for f in seen), "the engine's forward was meant to run the fused one"
    assert modeling_llama.apply_rotary_pos_emb is original


def test_fused_layers_settings(tiny_models, tmp_path, monkeypatch):
    """Unset: on for a GPU, and for a CPU in float32 where the C kernels build (not compiled there);
    asked for with torch_compile or on a model type the functions do not cover, a clear error."""
    require_c_kernels()
    settings = dict(device="cpu", num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=16)
    llm = LLM(tiny_models["llama"], dtype="float32", **settings)
    assert llm.runner.fused_layers is not None and not llm.runner.fused_layers.compiles
    assert LLM(tiny_models["llama"], dtype="bfloat16", **settings).runner.fused_layers is None
    monkeypatch.setattr(cpu_kernels, "layer_ops", lambda: None)  # no C compiler
    assert LLM(tiny_models["llama"], dtype="float32", **settings).runner.fused_layers is None
    with pytest.raises(ValueError, match="fused_layers and torch_compile"):
        EngineConfig(model=tiny_models["llama"], fused_layers=True, torch_compile=True)
    with pytest.raises(ValueError, match="fused_layers must be"):
        EngineConfig(model=tiny_models["llama"], fused_layers="yes")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512)).save_pretrained(gpt2)
    with pytest.raises(ValueError, match="fused layers cover the model types"):
        LLM(str(gpt2), device="cpu", dtype="float32", fused_layers=True, num_kv_blocks=16, max_num_seqs=2,
            max_num_batched_tokens=16)


@pytest.mark.parametrize("where", ["setting up torch.compile", "compiling"])
def test_fused_layers_that_fail_to_compile_leave_transformers_layers(tiny_models, hf_reference, monkeypatch, caplog,
                                                                     where, compiled_on_cpu):
    """Unset (on by default on a GPU), fused functions that fail to compile leave the model on
    transformers' own layers, with a warning that says why; asked for, the failure stops the start."""
    from inflight import fused_layers, model_runner

    def broken(*args):
        raise RuntimeError("no compiler here")

    if where == "compiling":
        monkeypatch.setitem(fused_layers._compiled, "rms_norm", broken)
    else:
        monkeypatch.setattr(fused_layers, "_compile_functions", broken)
    monkeypatch.setattr(model_runner.ModelRunner, "_use_fused_layers", lambda self: True)  # as on a GPU
    prompts = random_prompts(3, 1, 40, vocab=512, seed=3)
    llm = run_and_compare(tiny_models["llama"], prompts, hf_reference, device="cpu", dtype="float32",
                          num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=32)
    assert llm.runner.fused_layers is None
    assert "fused layers failed to compile, so transformers' own layers run: no compiler here" in caplog.text
    model = llm.runner.model.model
    assert "forward" not in vars(model.norm) and "forward" not in vars(model.layers[0])
    with pytest.raises(RuntimeError, match="no compiler here"):
        LLM(tiny_models["llama"], device="cpu", dtype="float32", fused_layers=True, num_kv_blocks=32,
            max_num_seqs=4, max_num_batched_tokens=32)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU")
def test_fused_layers_are_the_gpu_default(tiny_models):
    llm = LLM(tiny_models["llama"], device="cuda", num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=32)
    assert llm.runner.fused_layers is not None


def test_fused_layers_of_several_models_in_one_process(tiny_models, monkeypatch):
    """Each model, dtype and width compiles graphs of the same four functions (a benchmark builds
    several models in one process): they stay compiled, none falls back to eager at dynamo's recompile
    limit (made an error here)."""
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        for dtype in ("float32", "bfloat16"):
            llm = LLM(tiny_models[family], device="cpu", dtype=dtype, fused_layers=True, num_kv_blocks=32,
                      max_num_seqs=4, max_num_batched_tokens=32)
            outs = llm.generate([[5, 6, 7], list(range(3, 40))], SamplingParams(max_tokens=4, ignore_eos=True))
            assert all(len(out.token_ids) == 4 for out in outs)


def strided_case(rows: int, width: int, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """[1, rows, width] as the model hands it over: a slice of a wider matmul output (rows apart by more
    than `width`)."""
    return (torch.randn(1, rows, width + 40, generator=generator) * scale)[..., 8:8 + width]


@pytest.mark.parametrize("rows", [1, 7, 48, 300])  # (300 x 576 and up: split over the threads)
def test_cpu_layer_kernels_match_the_torch_functions(rows):
    """Each C kernel against the function it replaces (fused_layers.py's, transformers' arithmetic):
    RMSNorm and SiLU-and-multiply within float32 rounding, the rotary embedding exactly; on the strided
    views the model passes (slices of merged projections, queries and keys transposed to heads first)."""
    ops = require_c_kernels()
    g = torch.Generator().manual_seed(rows)
    x, residual = strided_case(rows, 576, g), torch.randn(1, rows, 576, generator=g)
    weight = torch.randn(576, generator=g)
    for scale in (1.0, 1e-3):  # (at 1e-3 the mean square is about eps)
        rows_in = strided_case(rows, 576, g, scale)
        expected = fused_layers._rms_norm(rows_in, weight, 1e-6)
        torch.testing.assert_close(ops.rms_norm(rows_in, weight, 1e-6), expected, rtol=1e-5, atol=1e-5)
    total, normed = ops.add_rms_norm(x, residual, weight, 1e-6)
    expected_total, expected_normed = fused_layers._add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, expected_total)
    torch.testing.assert_close(normed, expected_normed, rtol=1e-5, atol=1e-5)
    qkv = torch.randn(1, rows, (9 + 3 + 3) * 64, generator=g)  # one matmul's queries, keys and values
    q = qkv[..., :9 * 64].view(1, rows, 9, 64).transpose(1, 2)
    k = qkv[..., 9 * 64:12 * 64].view(1, rows, 3, 64).transpose(1, 2)
    angles = torch.rand(1, rows, 32, generator=g) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    for got, expected in zip(ops.rotary(q, k, cos, sin), fused_layers._rotary(q, k, cos, sin)):
        assert got.shape == expected.shape and torch.equal(got, expected)
        assert got.transpose(1, 2).is_contiguous()  # token-major, as the attention reads it
    gate_up = torch.randn(1, rows, 2 * 1536, generator=g) * 4
    gate, up = gate_up[..., :1536], gate_up[..., 1536:]
    torch.testing.assert_close(ops.silu_mul(gate, up), fused_layers._silu_mul(gate, up), rtol=1e-6, atol=1e-6)
    # Qwen3's per-head norm of queries: rows that are no plain view of the tensor's memory.
    heads = qkv[..., :9 * 64].view(1, rows, 9, 64)
    head_weight = torch.randn(64, generator=g)
    torch.testing.assert_close(ops.rms_norm(heads, head_weight, 1e-6), fused_layers._rms_norm(heads, head_weight, 1e-6),
                               rtol=1e-5, atol=1e-5)


def test_cpu_layer_kernels_refuse_what_they_cannot_read():
    """Wrong dtypes and shapes are errors, never a read out of bounds; a batch of several sequences
    (not an engine step) takes transformers' arithmetic."""
    ops = require_c_kernels()
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="float32"):
        ops.rms_norm(x.bfloat16(), torch.ones(64, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="weight of shape"):
        ops.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="differ"):
        ops.silu_mul(x, torch.randn(4, 32))
    q, k, cos = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16), torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="one sequence"):
        ops.rotary(q, k, cos[:, :2], cos[:, :2])
    assert fused_layers._load_cpu_kernels()
    batch = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 3, 16), torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    for got, expected in zip(fused_layers._cpu_kernels["rotary"](*batch), fused_layers._rotary(*batch)):
        assert torch.equal(got, expected)
