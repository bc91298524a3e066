"""LoRA adapters: any mix of adapters and the base model in one step gives, token for token, what
peft's model gives for each request alone, whatever computes the layers and however the steps run."""

import json

import pytest
import torch

from conftest import random_prompts
from inflight import LLM, SamplingParams
from inflight.config import EngineConfig
from lora_adapters import make_lora_adapter, make_lora_adapters

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
ADAPTERS = [None, "alpha", "beta"]  # None: the base model

# How the layers are computed and how the steps run; on a GPU machine also there (graphs, pipelined).
MODES = {
    "packed": dict(device="cpu"),
    "unpacked-fused": dict(device="cpu", packed_weights=False, fused_layers=True),
    "pipelined": dict(device="cpu", async_scheduling=True),
}
if torch.cuda.is_available():
    MODES["cuda"] = dict(device="cuda")


class PeftReference:
    """Greedy continuations from peft's model (HF generate), one request at a time, memoized."""

    def __init__(self, model_dir: str, adapters: dict[str, str]):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        first, *others = adapters.items()
        self.model = PeftModel.from_pretrained(base, first[1], adapter_name=first[0]).eval()
        for name, path in others:
            self.model.load_adapter(path, adapter_name=name)
        self._cache = {}

    def __call__(self, prompt: list[int], lora_name: str | None, max_new_tokens: int = MAX_TOKENS) -> list[int]:
        key = (tuple(prompt), lora_name, max_new_tokens)
        if key not in self._cache:
            self._cache[key] = self.generate(prompt, lora_name, max_new_tokens=max_new_tokens)[0]
        return self._cache[key]

    def generate(self, prompt: list[int], lora_name: str | None, **options) -> list[list[int]]:
        """HF `generate` (greedy unless `options` say otherwise) under an adapter (None: the base model):
        each returned sequence's new tokens."""
        ids = torch.tensor([prompt])
        options = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None,
                       pad_token_id=0, **options)
        with torch.inference_mode():
            if lora_name is None:
                with self.model.disable_adapter():
                    out = self.model.generate(**options)
            else:
                self.model.set_adapter(lora_name)
                out = self.model.generate(**options)
        return out[:, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    return make_lora_adapters(model, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def peft_reference(model, adapters):
    return PeftReference(model, adapters)


def generate_each(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> dict:
    """Every prompt under the base model and each adapter, all in one generate call."""
    cases = [(tuple(p), name) for name in ADAPTERS for p in prompts]
    outs = llm.generate([list(p) for p, _ in cases], params, lora_name=[name for _, name in cases])
    return {case: out for case, out in zip(cases, outs)}


def test_adapters_change_the_output(model, peft_reference):
    """The adapters are strong enough that equality below means something."""
    prompts = random_prompts(6, 2, 60, vocab=512, seed=11)
    for name in ("alpha", "beta"):
        differing = sum(peft_reference(p, name) != peft_reference(p, None) for p in prompts)
        assert differing >= 5, f"adapter {name} changed only {differing} of 6 outputs"


@pytest.mark.parametrize("mode", list(MODES))
def test_adapters_and_the_base_model_batched_equal_peft(model, adapters, peft_reference, mode):
    prompts = random_prompts(8, 1, 150, vocab=512, seed=5)
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_seqs=32, max_num_batched_tokens=128,
              lora_modules=adapters, **MODES[mode])
    outs = generate_each(llm, prompts)
    for (prompt, name), out in outs.items():
        assert out.token_ids == peft_reference(list(prompt), name), f"adapter {name}, prompt of {len(prompt)} tokens"
    if mode == "cuda":
        assert llm.runner.graphs.replays > 0, "decode steps were meant to replay CUDA graphs"
    if mode == "unpacked-fused":
        assert llm.runner.fused_layers is not None and llm.runner.fused_layers.norms > 0
    assert llm.runner.lora.active
    # Steps of the base model alone compute no adapter (with CUDA graphs: the buckets captured without).
    replays = llm.runner.graphs.replays if mode == "cuda" else 0
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [peft_reference(p, None) for p in prompts]
    assert not llm.runner.lora.active
    if mode == "cuda":
        assert llm.runner.graphs.replays > replays
    llm.block_manager.check_all_free()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_model_families_with_adapters_equal_peft(tiny_models, tmp_path, family):
    """Qwen2 (biased projections), Qwen3 (query and key norms) and Mistral (sliding window) too."""
    adapters = make_lora_adapters(tiny_models[family], tmp_path)
    reference = PeftReference(tiny_models[family], adapters)
    prompts = random_prompts(4, 1, 90, vocab=512, seed=6)
    llm = LLM(tiny_models[family], dtype="float32", device="cpu", num_kv_blocks=128, lora_modules=adapters)
    for (prompt, name), out in generate_each(llm, prompts).items():
        assert out.token_ids == reference(list(prompt), name), f"adapter {name}, prompt of {len(prompt)} tokens"


@pytest.mark.slow
def test_default_model_with_adapters_equals_peft(default_model, tmp_path):
    adapters = make_lora_adapters(default_model, tmp_path)
    reference = PeftReference(default_model, adapters)
    prompts = random_prompts(3, 4, 40, vocab=49152, seed=2)
    llm = LLM(default_model, dtype="float32", num_kv_blocks=128, lora_modules=adapters)
    for (prompt, name), out in generate_each(llm, prompts).items():
        assert out.token_ids == reference(list(prompt), name, MAX_TOKENS), f"adapter {name}"


def test_the_prefix_cache_keeps_each_adapters_kv_apart(model, adapters, peft_reference):
    """A prompt cached under one adapter (or none) is computed anew under another, and reused under the
    same one."""
    prompt = random_prompts(1, 70, 70, vocab=512, seed=8)[0]
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=256, lora_modules=adapters)
    hits = []
    for name in (None, "alpha", "beta", "alpha", None):
        out = llm.generate([prompt], GREEDY, lora_name=name)[0]
        assert out.token_ids == peft_reference(prompt, name), f"adapter {name}"
        hits.append(llm.stats()["prefix_cache_hit_tokens"] - sum(hits))
    assert hits == [0, 0, 0, 64, 64], hits
    assert llm.stats()["lora_requests"] == {"alpha": (0, 0, 2), "beta": (0, 0, 1)}  # (running, waiting, total)
    llm.block_manager.check_all_free()


def test_completions_and_preempted_sequences_keep_their_adapter(model, adapters, peft_reference):
    """The n completions of a request fork with its adapter, and a preempted sequence is recomputed
    with it."""
    prompts = random_prompts(6, 8, 30, vocab=512, seed=4)
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=64,
              lora_modules=adapters)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=2)
    outs = llm.generate(prompts, params, lora_name=[ADAPTERS[k % 3] for k in range(len(prompts))])
    for k, (prompt, out) in enumerate(zip(prompts, outs)):
        expected = peft_reference(prompt, ADAPTERS[k % 3], 40)
        assert [c.token_ids for c in out.outputs] == [expected, expected], f"adapter {ADAPTERS[k % 3]}"
    assert llm.stats()["num_preemptions"] > 0, "the pool was meant to be too small to hold every sequence"
    llm.block_manager.check_all_free()


def test_beam_search_keeps_its_adapter(model, adapters, peft_reference):
    """Every beam of a search runs on the request's adapter: the hypotheses equal peft's model's beam
    search, the base model's and each adapter's in one generate."""
    prompts = random_prompts(2, 8, 30, vocab=512, seed=6)
    params = SamplingParams(beam_width=3, n=2, max_tokens=12, ignore_eos=True)
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, lora_modules=adapters)
    cases = [(p, name) for name in ADAPTERS for p in prompts]
    outs = llm.generate([p for p, _ in cases], params, lora_name=[name for _, name in cases])
    for (prompt, name), out in zip(cases, outs):
        expected = peft_reference.generate(prompt, name, max_new_tokens=12, num_beams=3, num_return_sequences=2)
        assert [c.token_ids for c in out.outputs] == expected, f"adapter {name}"
    assert len({tuple(out.token_ids) for out in outs[:len(prompts)] + outs[-len(prompts):]}) > len(prompts)
    llm.block_manager.check_all_free()


def test_unknown_adapters_and_settings_are_refused(model, adapters):
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, lora_modules=adapters)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'gamma': this server has 'alpha', 'beta'"):
        llm.add_request("r", [5, 6, 7], GREEDY, lora_name="gamma")
    plain = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'alpha': this server has none"):
        plain.generate([[5, 6, 7]], GREEDY, lora_name="alpha")
    assert not llm.has_unfinished() and not plain.has_unfinished()
    assert "lora_requests" not in plain.stats()
    llm.add_request("n2", [5, 6, 7], SamplingParams(max_tokens=50, n=2), lora_name="beta")
    assert llm.stats()["lora_requests"] == {"alpha": (0, 0, 0), "beta": (0, 1, 1)}  # a request once, not per completion
    llm.step()
    assert llm.stats()["lora_requests"] == {"alpha": (0, 0, 0), "beta": (1, 0, 1)}
    first = next(seq for seq in llm.scheduler.running if seq.index == 0)
    llm.scheduler.finish(first, "stop")  # its first completion ended, the other runs on: still running
    assert llm.stats()["lora_requests"] == {"alpha": (0, 0, 0), "beta": (1, 0, 1)}
    llm.abort("n2")
    llm.step()
    assert llm.stats()["lora_requests"]["beta"] == (0, 0, 1)
    for settings, message in ((dict(lora_modules={"a": ""}), "lora_modules must map adapter names"),
                              (dict(lora_modules=["a"]), "lora_modules must map adapter names"),
                              (dict(lora_modules=adapters, tensor_parallel_size=2), "tensor_parallel_size 1"),
                              (dict(lora_modules=adapters, torch_compile=True), "torch_compile")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(model, device="cpu", **settings)


@pytest.mark.parametrize("case", ["dora", "head", "missing", "not-lora", "another-model"])
def test_adapters_that_cannot_be_served_exactly_are_refused_at_start_up(model, tiny_models, tmp_path, case):
    if case == "another-model":  # Qwen3's tiny checkpoint: 4 heads of 32, Llama's of 16
        path, message = make_lora_adapter(tiny_models["qwen3"], tmp_path / "q", 1, r=4, target_modules=["q_proj"]), \
            "do not fit the layer"
    elif case == "dora":
        path, message = make_lora_adapter(model, tmp_path / "d", 1, r=4, target_modules=["q_proj"], use_dora=True), \
            "uses use_dora"
    elif case == "head":
        path, message = make_lora_adapter(model, tmp_path / "h", 1, r=4, target_modules=["q_proj", "lm_head"]), \
            "targets 'lm_head': the output head"
    elif case == "missing":
        path, message = str(tmp_path / "nowhere"), "could not be read from"
    else:
        path = make_lora_adapter(model, tmp_path / "x", 1, r=4, target_modules=["q_proj"])
        config = json.loads((tmp_path / "x" / "adapter_config.json").read_text())
        (tmp_path / "x" / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
        message = "not LoRA|could not be read"
    with pytest.raises(ValueError, match=f"LoRA adapter 'bad'.*({message})"):
        LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, lora_modules={"bad": path})
