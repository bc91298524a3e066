"""The CPU's fast path: linear layers through oneDNN with packed weights, and the allocator setting."""

import functools
import platform

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight import LLM
from inflight import cpu_runtime
from inflight.cpu_runtime import keep_freed_memory, pack_linear_layers, packing_available, padded_rows

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN weight packing")


def logits(model, ids):
    with torch.inference_mode():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("merge", [False, True], ids=["each", "siblings merged"])
@pytest.mark.parametrize("model_name", ["default", "qwen2"])
def test_packed_layers_compute_what_transformers_does(model_name, merge, default_model, tiny_models):
    """Same logits within float32 rounding; every linear layer packed; hooks still run; a weight tied to
    the embedding is kept, the others are released. Siblings merged: a layer's queries, keys and values
    are one oneDNN matmul, and its gate and up projections another."""
    path = default_model if model_name == "default" else tiny_models[model_name]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
    expected = logits(model, ids)
    embedding = model.get_input_embeddings().weight.detach().clone()
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    seen = []
    linears[0].register_forward_hook(lambda module, args, output: seen.append(output.shape))

    assert pack_linear_layers(model, 64, 64, head_rows=8, merge_siblings=merge) == len(linears)  # the head: 37 rows
    with torch.profiler.profile() as prof:
        got = logits(model, ids)
    matmuls = sum(event.name == "mkldnn::_linear_pointwise" for event in prof.events())
    assert matmuls == (4 if merge else 7) * model.config.num_hidden_layers + 1

    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    assert seen and seen[-1] == expected.shape[:2] + (linears[0].out_features,)
    torch.testing.assert_close(model.get_input_embeddings().weight, embedding, atol=0, rtol=0)
    def released(linear):
        return linear.weight.untyped_storage().nbytes() == linear.weight.element_size()

    assert released(model.lm_head) != model.config.tie_word_embeddings
    mlp = model.model.layers[0].mlp.down_proj
    assert released(mlp) and mlp.weight.shape == (mlp.out_features, mlp.in_features)


def test_every_row_count_runs_at_its_bucket():
    """Row counts are padded to a few buckets (one oneDNN kernel each, built at start-up); the padding
    never shows in the output."""
    layer = torch.nn.Linear(48, 40)
    model = torch.nn.Sequential(layer)
    expected = {rows: layer(torch.randn(3, rows, 48, generator=torch.Generator().manual_seed(rows)))
                for rows in range(1, 140)}
    pack_linear_layers(model, 64, 139)
    for rows, out in expected.items():
        got = model(torch.randn(3, rows, 48, generator=torch.Generator().manual_seed(rows)))
        torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)
    assert [padded_rows(n) for n in (1, 16, 17, 24, 25, 64, 65, 96, 97, 512)] == [1, 16, 24, 24, 32, 64, 96, 96,
                                                                                     128, 512]


def test_a_row_gets_the_same_bits_alone_or_among_others():
    """oneDNN computes a row alone with another kernel for some shapes (on the development hosts, layers
    reading more than ~1,000 features): such a layer runs a lone row as two, so that a token's values do
    not depend on what else its step holds."""
    for features in (64, 1536, 4096):
        model = torch.nn.Sequential(torch.nn.Linear(features, 96))
        pack_linear_layers(model, 16, 16)
        x = torch.randn(16, features, generator=torch.Generator().manual_seed(features))
        alone = model(x[:1])
        for rows in (2, 5, 16):
            assert torch.equal(model(x[:rows])[0], alone[0]), (features, rows)


def test_the_output_head_is_built_for_the_rows_a_step_samples(tiny_models, monkeypatch):
    """Start-up builds the head's kernels up to the rows a step samples, the other layers' up to the
    step's tokens: over a wide vocabulary, the head's were most of the start-up's time."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    widths = [m.out_features for m in model.modules() if type(m) is torch.nn.Linear]
    assert widths.count(model.config.vocab_size) == 1  # the head is the only layer of its width
    built = {}
    packed_forward = cpu_runtime._packed_forward

    def recording(weight, bias, one_row_as, x):
        out = packed_forward(weight, bias, one_row_as, x)
        built.setdefault(out.shape[-1], set()).add(x.shape[0])
        return out

    monkeypatch.setattr(cpu_runtime, "_packed_forward", recording)
    pack_linear_layers(model, 8, 200, head_rows=12)
    assert built.pop(model.config.vocab_size) == set(range(1, 13))
    buckets = {padded_rows(n) for n in range(1, 201)}
    assert built and all(rows == buckets for rows in built.values())


@pytest.mark.parametrize("packed", [True, False])
def test_engine_packs_on_a_cpu_when_asked(tiny_models, packed):
    llm = LLM(tiny_models["llama"], device="cpu", num_kv_blocks=64, packed_weights=packed)
    up_proj = llm.runner.model.model.layers[0].mlp.up_proj
    assert isinstance(up_proj.forward, functools.partial) == packed


def test_the_allocator_keeps_freed_memory_under_glibc():
    assert keep_freed_memory() == (platform.libc_ver()[0] == "glibc")


def test_a_cpu_pool_takes_memory_as_its_blocks_are_written(tiny_models):
    """The KV pool of a CPU engine is not written at start-up (a fifth of the host's free memory by default:
    seconds of memset): its pages are mapped as blocks are first written, and read as zeros until then. Its
    blocks are made as they are first used, and a freed block is used again before a fresh one, so memory
    grows with the blocks in use at once, not with the requests served."""
    import psutil

    from inflight import SamplingParams

    rss = psutil.Process().memory_info().rss
    llm = LLM(tiny_models["llama"], device="cpu", kv_cache_memory=1 << 30, enable_prefix_caching=False)
    runner = llm.runner
    assert runner.num_blocks * runner.bytes_per_block > 0.9 * (1 << 30)
    assert psutil.Process().memory_info().rss - rss < (1 << 30) // 4
    assert len(llm.block_manager.blocks) == 0 and not runner.kv_cache[:, :, -1].any()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for turn in range(6):
        llm.generate([[1 + turn, 2, 3, 4, 5]] * 2, params)
    # Two sequences of 45 tokens at once: 3 blocks of 16 each, the same 6 blocks every turn.
    assert sorted(llm.block_manager.blocks) == list(range(6))
    assert runner.kv_cache[:, :, :6].any() and not runner.kv_cache[:, :, 6:].any()
    with pytest.raises(IndexError, match="is not in the pool"):
        llm.block_manager.blocks[runner.num_blocks]
