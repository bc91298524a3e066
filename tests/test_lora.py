"""LoRA adapters: any mix of adapters and the base model in one step gives, token for token, what
peft's model gives for each request alone, whatever computes the layers and however the steps run."""

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import make_tiny_model, random_prompts
from inflight import LLM, LoRATask, SamplingParams
from inflight.config import EngineConfig
from lora_adapters import make_lora_adapter, make_lora_adapters, trtllm_lora_tensors

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


# -- TensorRT-LLM's LoRA inputs: adapters sent with requests (lora_tasks.py) -----------------------------
def task_of(adapter_dir: str, task_id: int, dtype=np.float32) -> LoRATask:
    return LoRATask(task_id, *trtllm_lora_tensors(adapter_dir, dtype))


@pytest.mark.parametrize("mode", list(MODES))
def test_lora_tasks_sent_with_requests_equal_peft(model, adapters, peft_reference, mode):
    """The adapters as TensorRT-LLM's lora_weights / lora_config, each sent with its first requests and
    named by its task id alone after, mixed with the base model in one batch: peft's tokens."""
    prompts = random_prompts(6, 1, 150, vocab=512, seed=5)
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_seqs=32, max_num_batched_tokens=128,
              lora_task_slots=2, **MODES[mode])
    sent = {None: None, "alpha": task_of(adapters["alpha"], 7), "beta": task_of(adapters["beta"], 2**64 - 1)}
    by_id = {None: None, "alpha": LoRATask(7), "beta": LoRATask(2**64 - 1)}
    for tasks in (sent, by_id):
        cases = [(p, name) for name in tasks for p in prompts]
        outs = llm.generate([p for p, _ in cases], GREEDY, lora_task=[tasks[name] for _, name in cases])
        for (prompt, name), out in zip(cases, outs):
            assert out.token_ids == peft_reference(prompt, name), f"adapter {name}, prompt of {len(prompt)} tokens"
    assert llm.stats()["lora_task_loads"] == 2
    if mode == "cuda":
        assert llm.runner.graphs.replays > 0, "decode steps were meant to replay CUDA graphs"
    llm.block_manager.check_all_free()


def test_lora_tasks_beside_named_adapters_and_in_fused_forms(model, adapters, peft_reference, tmp_path):
    """A task beside lora_modules' adapters; a task whose q and v adapters come as one attn_qkv row
    (A stacked, B's rows in blocks); and Phi-3's fused qkv_proj and gate_up_proj adapted by rows."""
    prompts = random_prompts(4, 1, 90, vocab=512, seed=6)
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=128, lora_modules={"beta": adapters["beta"]},
              lora_task_slots=1)
    weights, config = trtllm_lora_tensors(adapters["alpha"])
    qkv_rows, qkv_config = [], []
    hidden, q_out = 64, 64  # the tiny Llama: hidden 64, 4 heads and 2 KV heads of 16
    for layer in sorted(set(config[:, 1].tolist())):
        (q,), (v,) = (np.flatnonzero((config[:, 0] == module) & (config[:, 1] == layer)) for module in (1, 3))
        r = config[q, 2]
        a_q, b_q = weights[q, :r * hidden].reshape(r, hidden), weights[q, r * hidden:r * hidden + q_out * r]
        a_v, b_v = weights[v, :r * hidden].reshape(r, hidden), weights[v, r * hidden:r * hidden + 32 * r]
        b = np.zeros((q_out + 32 + 32, 2 * r), np.float32)
        b[:q_out, :r], b[q_out + 32:, r:] = b_q.reshape(q_out, r), b_v.reshape(32, r)
        qkv_rows.append(np.concatenate([np.concatenate([a_q, a_v]).ravel(), b.ravel()]))
        qkv_config.append([0, layer, 2 * r])
    fused = LoRATask(3, np.stack(qkv_rows), np.array(qkv_config, np.int32))
    cases = [(p, name) for name in ADAPTERS for p in prompts]
    outs = llm.generate([p for p, _ in cases], GREEDY,
                        lora_name=["beta" if name == "beta" else None for _, name in cases],
                        lora_task=[fused if name == "alpha" else None for _, name in cases])
    for (prompt, name), out in zip(cases, outs):
        assert out.token_ids == peft_reference(prompt, name), f"adapter {name}"

    phi3 = str(make_tiny_model("phi3", tmp_path / "phi3-model"))
    # (rank 8: qkv_proj's one A serves its three parts, 8 columns of the 16 a slot has, not 24)
    adapter = make_lora_adapter(phi3, tmp_path / "phi3", 3, r=8, lora_alpha=16,
                                target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    reference = PeftReference(phi3, {"phi3": adapter})
    llm = LLM(phi3, dtype="float32", device="cpu", num_kv_blocks=128, lora_task_slots=1)
    outs = llm.generate(prompts, GREEDY, lora_task=task_of(adapter, 1))
    expected = [reference(p, "phi3") for p in prompts]
    assert [o.token_ids for o in outs] == expected
    assert sum(e != reference(p, None) for e, p in zip(expected, prompts)) >= 3, "the adapter changed little"
    # (on a fused layer, the ranks of its parts' adapters share the slot)
    narrow = LLM(phi3, dtype="float32", device="cpu", num_kv_blocks=64, lora_task_slots=1, max_lora_rank=4)
    with pytest.raises(ValueError, match=r"adapters of model.layers.0.self_attn.qkv_proj add up to rank 8, more "
                                         r"than max_lora_rank \(4\)"):
        narrow.add_request("r", [5, 6], GREEDY, lora_task=LoRATask(1, np.zeros((2, 4096), np.float32),
                                                                  np.array([[1, 0, 4], [2, 0, 4]], np.int32)))


def test_lora_task_slots_evict_refuse_and_keep_the_prefix_cache_apart(model, adapters, peft_reference):
    """One slot: a new task takes it from an idle one (whose id then needs its weights again); a task
    that finds it held by a running request is refused (UNAVAILABLE) and that request goes on; a task id
    sent again with other weights replaces them, and its prompts' cached KV is not reused across."""
    prompt = random_prompts(1, 70, 70, vocab=512, seed=8)[0]
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, lora_task_slots=1)
    alpha, beta = task_of(adapters["alpha"], 1), task_of(adapters["beta"], 2)

    def run(task, expected_adapter):
        hits = llm.stats()["prefix_cache_hit_tokens"]
        out = llm.generate([prompt], GREEDY, lora_task=task)[0]
        assert out.error is None and out.token_ids == peft_reference(prompt, expected_adapter)
        return llm.stats()["prefix_cache_hit_tokens"] - hits

    assert run(alpha, "alpha") == 0
    assert run(LoRATask(1), "alpha") == 64  # the same task: its KV reused
    assert run(beta, "beta") == 0  # task 1 was idle: evicted
    with pytest.raises(ValueError, match="LoRA task 1 is not in the cache: send its lora_weights"):
        llm.add_request("gone", prompt, GREEDY, lora_task=LoRATask(1))
    assert run(LoRATask(2, alpha.weights, alpha.config), "alpha") == 0  # task 2 replaced: no KV of beta's
    assert llm.stats()["lora_task_loads"] == 3

    llm.add_request("running", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                    lora_task=LoRATask(2))
    deltas = {"running": llm.step()}
    llm.add_request("another", prompt, GREEDY, lora_task=LoRATask(3, beta.weights, beta.config))
    llm.add_request("replacing", prompt, GREEDY, lora_task=LoRATask(2, beta.weights, beta.config))
    while llm.has_unfinished():
        for delta in llm.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    assert [(d.error_kind, d.finish_reason) for d in deltas["another"]] == [("unavailable", "error")]
    assert "every one of the 1 LoRA task slots (lora_task_slots) holds a task" in deltas["another"][0].error
    assert "LoRA task 2 is in use with other weights" in deltas["replacing"][0].error
    running = [t for d in deltas["running"] for t in d.new_token_ids]
    assert deltas["running"][-1].error is None and running == peft_reference(prompt, "alpha", 30)
    assert run(beta, "beta") == 0  # the slot free again
    llm.block_manager.check_all_free()


def _row(module: int, layer: int, rank: int, values: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    return np.full((1, values), 0.01, np.float32), np.array([[module, layer, rank]], np.int32)


@pytest.mark.parametrize("task, message", [
    (LoRATask(1, *_row(9, 0, 4)), "module cross_attn_q is not served"),
    (LoRATask(1, *_row(20, 0, 4)), "unknown module id"),
    (LoRATask(1, *_row(1, 99, 4)), "the model has no such projection in that layer"),
    (LoRATask(1, *_row(1, 0, 0)), r"the adapter size must be in \[1, max_lora_rank = 16\]"),
    (LoRATask(1, *_row(1, 0, 17)), r"the adapter size must be in \[1, max_lora_rank = 16\]"),
    (LoRATask(1, *_row(1, 0, 4, values=100)), r"need 512 values, more than lora_weights' rows hold \(100\)"),
    (LoRATask(1, np.zeros((2, 4096), np.float32), np.array([[1, 0, 4], [1, 0, 4]], np.int32)),
     "layer 0's q projection is adapted already by row 0"),
    (LoRATask(1, np.zeros((2, 4096), np.float32), np.array([[0, 1, 4], [3, 1, 4]], np.int32)),
     "layer 1's v projection is adapted already by row 0"),
    (LoRATask(1, _row(1, 0, 4)[0], None), "lora_weights and lora_config come together"),
    (LoRATask(1, None, _row(1, 0, 4)[1]), "lora_weights and lora_config come together"),
    (LoRATask(1, _row(1, 0, 4)[0], np.array([[1, 0]], np.int32)),
     r"lora_config must be integers of shape \[rows, 3\]"),
    (LoRATask(1, np.zeros((2, 4096), np.float32), _row(1, 0, 4)[1]),
     r"lora_weights must be floats of shape \[1, width\]"),
    (LoRATask(1, np.full((1, 4096), np.nan, np.float32), _row(1, 0, 4)[1]), "NaN or an infinity"),
    (LoRATask(-1), r"lora_task_id must be an integer in \[0, 2\*\*64\)"),
    (LoRATask(5), "LoRA task 5 is not in the cache: send its lora_weights and lora_config with it"),
])
def test_bad_lora_tasks_are_refused_by_name(model, task, message):
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, lora_task_slots=2)
    with pytest.raises(ValueError, match=message):
        llm.add_request("bad", [5, 6, 7], GREEDY, lora_task=task)
    assert not llm.has_unfinished()


def test_lora_task_settings_are_checked(model, adapters):
    task = task_of(adapters["alpha"], 1)
    with pytest.raises(ValueError, match="takes no LoRA adapters with requests .* its lora_task_slots is 0"):
        LLM(model, dtype="float32", device="cpu", num_kv_blocks=64).add_request("r", [5, 6], GREEDY, lora_task=task)
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, lora_modules=adapters, lora_task_slots=1,
              max_lora_rank=4)
    with pytest.raises(ValueError, match="by lora_name or by lora_task_id, not both"):
        llm.add_request("r", [5, 6], GREEDY, lora_name="beta", lora_task=task)
    with pytest.raises(ValueError, match=r"adapter size must be in \[1, max_lora_rank = 4\]"):
        llm.add_request("r", [5, 6], GREEDY, lora_task=task)  # alpha's rank 8
    for settings, message in ((dict(lora_task_slots=-1), "lora_task_slots must be an integer of at least 0"),
                              (dict(lora_task_slots=True), "lora_task_slots must be an integer"),
                              (dict(max_lora_rank=0), "max_lora_rank must be an integer of at least 1"),
                              (dict(lora_task_slots=2, torch_compile=True), "lora_task_slots and torch_compile")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(model, device="cpu", **settings)


@pytest.mark.parametrize("seed", range(2))
def test_random_requests_over_changing_tasks(model, adapters, seed):
    """Random requests over three task ids, each sent with alpha's or beta's weights or by id alone, beside
    the base model, with aborts, one or two slots and a pool small enough to preempt: every request that
    ends well has the tokens of the adapter its task held when it was placed (the named adapter's, in
    an engine of its own); the others end aborted or refused as documented; every block comes back."""
    rng = random.Random(seed)
    tensors = {name: trtllm_lora_tensors(path) for name, path in adapters.items()}
    named = LLM(model, dtype="float32", device="cpu", num_kv_blocks=128, lora_modules=adapters)
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=12, block_size=8, max_num_seqs=6,
              max_num_batched_tokens=64, lora_task_slots=1 + seed, async_scheduling=seed == 1)
    held: dict[int, str] = {}  # task id -> the adapter its slot holds, as placed
    live: dict[str, list] = {}  # request id -> [prompt, task, adapter, max_tokens, tokens]
    placed_next: list[str] = []  # added since the last step, whose drain places (or refuses) them in order
    ends = Counter()

    def step():
        deltas = llm.step()
        refused = {d.request_id for d in deltas if d.error}
        for request_id in placed_next:
            request = live[request_id]
            if request[1] is not None and request_id not in refused:
                if request[1].weights is not None:
                    held[request[1].task_id] = request[2]
                else:
                    request[2] = held[request[1].task_id]
        placed_next.clear()
        for d in deltas:
            request = live[d.request_id]
            request[4] += d.new_token_ids
            if not d.finished:
                continue
            del live[d.request_id]
            if d.error:
                assert d.error_kind in ("unavailable", "invalid") and any(
                    words in d.error for words in ("every one of", "in use with other weights", "not in the cache"))
                ends[d.error_kind] += 1
            elif d.finish_reason == "abort":
                ends["aborted"] += 1
            else:
                prompt, _, name, max_tokens, tokens = request
                expected = named.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True), lora_name=name)[0].token_ids
                assert tokens == expected, f"request {d.request_id}, adapter {name}"
                ends["ok"] += 1

    for k, prompt in enumerate(random_prompts(30, 3, 60, vocab=512, seed=seed)):
        task, name = None, None
        if rng.random() < 0.75:
            name = rng.choice([None, "alpha", "beta"])
            task = LoRATask(rng.choice([1, 2, 3]), *tensors[name]) if name else LoRATask(rng.choice([1, 2, 3]))
        request = [prompt, task, name, rng.randint(1, 16), []]
        try:
            llm.add_request(str(k), prompt, SamplingParams(max_tokens=request[3], temperature=0.0, ignore_eos=True),
                            lora_task=task)
            live[str(k)] = request
            placed_next.append(str(k))
        except ValueError as e:
            assert "is not in the cache" in str(e), e
            ends["refused"] += 1
        if live and rng.random() < 0.1:
            llm.abort(rng.choice(list(live)))
        for _ in range(rng.randint(0, 3)):
            step()
    while llm.has_unfinished():
        step()
    assert ends["ok"] >= 10 and ends["refused"] + ends["unavailable"] >= 1 and llm.stats()["num_preemptions"], ends
    llm.block_manager.check_all_free()
