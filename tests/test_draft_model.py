"""Speculative decoding with a draft model (speculative_config's "draft_model" method): greedy output equal
to HF transformers' with drafts kept and rejected, an identical draft model's drafts all but always kept,
every proposal the draft model's own greedy continuation (what shows its KV follows each sequence: through
preemption, the prefix cache, a budget smaller than a prompt, forks and async scheduling), seeded
sampling, grammars, a draft vocabulary wider than the model's, the pool shared between the two models, what
is refused, and served through tritonserver."""

import json
import shutil
import time

import numpy as np
import pytest
import torch

from conftest import ROOT, assert_all_blocks_free, greedy, random_prompts, serve
from inflight import LLM, SamplingParams
from inflight.config import EngineConfig
from inflight.model_runner import ModelRunner
from test_speculative import ON_A_GPU, REPEATING, _repeating_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _draft(model: str, k: int = 4, **settings) -> dict:
    return {"model": model, "num_speculative_tokens": k, **settings}


def _spec_counts(llm: LLM, before: dict | None = None) -> tuple[int, int]:
    """(drafts kept, drafts judged) since `before` (a stats() of the same engine)."""
    stats, before = llm.stats(), before or {}
    return (stats["spec_decode_accepted_tokens_total"] - before.get("spec_decode_accepted_tokens_total", 0),
            stats["spec_decode_draft_tokens_total"] - before.get("spec_decode_draft_tokens_total", 0))


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory):
    """Draft checkpoints for the tiny Llama: `near` (its second layer's MLP halved: most drafts right, not
    all), `wide` (8 tokens more, which its head ranks first: drafts the model has no ids for, unless cut),
    `other_tokenizer` (two of the tokenizer's tokens swapped)."""
    root, target = tmp_path_factory.mktemp("drafts"), tiny_models["llama"]
    made = {}
    near = _hf_model(target)
    with torch.no_grad():
        near.model.layers[1].mlp.down_proj.weight.mul_(0.5)
    near.save_pretrained(root / "near")
    wide = _hf_model(target)
    wide.resize_token_embeddings(520, mean_resizing=False)
    with torch.no_grad():
        wide.lm_head.weight[512:] = 10 * wide.lm_head.weight[:512].abs().max()
        wide.lm_head.weight[512:, :32] *= -1  # (not all equal: some token beyond 512 wins every row)
    wide.save_pretrained(root / "wide")
    for name in ("near", "wide", "other_tokenizer"):  # (the tokenizer's files; other_tokenizer's weights too)
        saved = None if name == "other_tokenizer" else shutil.ignore_patterns("*.safetensors", "config.json")
        shutil.copytree(target, root / name, dirs_exist_ok=True, ignore=saved)
        made[name] = str(root / name)
    tokenizer = json.loads((root / "other_tokenizer" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (root / "other_tokenizer" / "tokenizer.json").write_text(json.dumps(tokenizer))
    return made


@pytest.mark.parametrize("settings, message", [
    (dict(method="draft_model"), "needs model, the draft model's folder"),
    (dict(method="ngram", model="x"), 'method "draft_model", not "ngram"'),
    (dict(method="eagle", model="x"), r"method 'eagle' is not served: \"ngram\" .* or \"draft_model\""),
    (dict(model="x", prompt_lookup_max=3), "prompt_lookup_max: the \"ngram\" method's"),
    (dict(model=""), "needs model"),
    (dict(model="x", draft_tensor_parallel_size=2), "draft_tensor_parallel_size must be 1, got 2"),
])
def test_the_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", device="cpu", speculative_config={"num_speculative_tokens": 2, **settings})


def test_the_method_follows_from_a_model():
    config = EngineConfig(model="m", device="cpu", speculative_config={"model": "d", "num_speculative_tokens": 2,
                                                                       "draft_tensor_parallel_size": 1})
    assert (config.speculative_config.method, config.speculative_config.model) == ("draft_model", "d")


@pytest.mark.parametrize("draft", ["same", "near"])
def test_greedy_output_equals_hf(tiny_models, drafts, hf_reference, draft):
    """Random prompts of 3 to 60 tokens: every output is HF's. The model as its own draft model has its
    drafts kept (all but a rounding's few); a draft model that differs a little has some rejected."""
    model = tiny_models["llama"]
    llm = LLM(model, num_kv_blocks=64, speculative_config=_draft(model if draft == "same" else drafts["near"]))
    prompts = random_prompts(8, 3, 60, 512, seed=11)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_reference(model, p, 40) for p in prompts]
    kept, judged = _spec_counts(llm)
    if draft == "same":
        assert kept >= 0.95 * judged > 0, (kept, judged)
    else:
        assert 0.2 * judged < kept < judged, (kept, judged)
    # kept by position after the last token: a draft is kept only after those before it
    by_position = llm.stats()["spec_decode_accepted_tokens_per_pos"]
    assert sum(by_position) == kept and len(by_position) <= 4
    assert all(earlier >= later for earlier, later in zip(by_position, by_position[1:])), by_position
    llm.block_manager.check_all_free()


@pytest.mark.parametrize("kv, tokens, held", [
    (None, 20, 0),
    ((10, [5, 6, 7]), 20, 13),  # every draft computed became its token
    ((10, [5, 9, 7]), 20, 11),  # the second was rejected: its KV, and the third's after it, are stale
    ((10, []), 20, 10),
    ((10, [5, 6, 7]), 12, 11),  # its last token is computed again, for the logits that propose
    ((10, [5, 6, 7]), 13, 12),
])
def test_what_its_kv_holds_of_a_sequence(kv, tokens, held):
    from types import SimpleNamespace

    from inflight.draft_model import DraftModel

    array = np.arange(tokens) + 100
    array[10:13] = [5, 6, 7][:max(0, tokens - 10)]
    seq = SimpleNamespace(draft_model_kv=kv, token_array=array, num_tokens=tokens)
    assert DraftModel._held(None, seq) == held


def _run_preempting(llm: LLM, prompts: list[list[int]], params: SamplingParams, at_steps: set[int]) -> list[list[int]]:
    """Each prompt's tokens, stepping the engine by hand; at each of `at_steps`, the running sequence that
    has drafted longest is preempted (its blocks given back, the draft model's KV with them)."""
    for i, prompt in enumerate(prompts):
        llm.add_request(str(i), prompt, params)
    tokens, step = {}, 0
    while llm.has_unfinished():
        step += 1
        if step in at_steps:
            drafted = [seq for seq in llm.scheduler.running if seq.draft_model_kv is not None]
            assert drafted, step
            seq = max(drafted, key=lambda seq: seq.draft_model_kv[0])
            llm.scheduler.preempt(seq)
            assert seq.draft_model_kv is None
        for delta in llm.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_its_kv_follows_preemption_a_small_budget_the_prefix_cache_and_forks(tiny_models, drafts, hf_reference,
                                                                           monkeypatch, async_scheduling):
    """Sequences preempted (their draft KV computed again), a budget of 16 tokens (prompts of up to 40
    caught up in several passes), the same prompts again (their blocks found in the prefix cache: the
    draft model computes them again) and n=2 (forked completions): outputs equal HF's, and every proposal
    is HF's greedy continuation of the sequence by the draft model, which it is not where the draft model's
    KV is read from the wrong blocks, rows or positions (or holds drafts the model rejected)."""
    from inflight.draft_model import DraftModel

    model, draft = tiny_models["llama"], drafts["near"]
    proposals = []
    proposing = DraftModel._draft

    def recorded(self, seqs):
        contexts = [seq.token_ids for seq in seqs]
        drafted = proposing(self, seqs)
        proposals.extend(zip(contexts, drafted))
        return drafted

    monkeypatch.setattr(DraftModel, "_draft", recorded)
    prompts = _repeating_prompts(8, 512, seed=5) + random_prompts(2, 30, 40, 512, seed=3)
    llm = LLM(model, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=16, async_scheduling=async_scheduling,
              speculative_config=_draft(draft, 6))
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = [hf_reference(model, prompt, 48) for prompt in prompts]
    assert _run_preempting(llm, prompts, params, {8, 12, 16}) == expected
    assert llm.stats()["num_preemptions"] == 3
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    twice = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2))
    assert all(c.token_ids == e[:24] for o, e in zip(twice, expected) for c in o.outputs)
    kept, judged = _spec_counts(llm)
    assert 0 < kept < judged
    assert len(proposals) > 100
    for context, proposed in proposals:
        assert proposed == hf_reference(draft, context, len(proposed)), context
    llm.block_manager.check_all_free()


def test_seeded_sampling_repeats_and_drafts_are_kept(tiny_models, drafts):
    model = tiny_models["llama"]
    llm = LLM(model, num_kv_blocks=64, speculative_config=_draft(drafts["near"]))
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=32, seed=5, n=2, ignore_eos=True)
    prompts = random_prompts(3, 5, 20, 512, seed=2)
    first, again = (llm.generate(prompts, params) for _ in range(2))
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs] for o in again]
    assert first[0].outputs[0].token_ids != first[0].outputs[1].token_ids
    assert _spec_counts(llm)[0] > 0
    llm.block_manager.check_all_free()


def test_a_draft_vocabulary_wider_than_the_models_is_cut(tiny_models, drafts, hf_reference):
    """The draft model ranks tokens 512-519 first, which the model has no ids for: it drafts its best of
    the model's 512 instead (the same as the model's), so the output is HF's and most drafts are kept."""
    model = tiny_models["llama"]
    llm = LLM(model, num_kv_blocks=64, speculative_config=_draft(drafts["wide"]))
    prompts = random_prompts(4, 5, 30, 512, seed=8)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == [hf_reference(model, p, 40)
                                                                               for p in prompts]
    kept, judged = _spec_counts(llm)
    assert kept >= 0.95 * judged > 0, (kept, judged)


def test_the_pool_makes_room_for_the_draft_model(tiny_models, drafts):
    """The model's pool, sized from a memory budget, holds the draft model's KV of each block beside its
    own; the draft pool has as many blocks; the footprint counted before loading is what was loaded."""
    from inflight.draft_model import DraftModel

    model = tiny_models["llama"]
    budget = 1 << 20
    llm = LLM(model, kv_cache_memory=budget, speculative_config=_draft(drafts["near"]))
    draft = llm.draft_model.runner
    per_block, weights = DraftModel.footprint(llm.config)
    assert per_block == draft.bytes_per_block
    assert weights == sum(p.numel() * p.element_size() for p in draft.model.parameters())
    assert llm.runner.num_blocks == budget // (llm.runner.bytes_per_block + per_block) == draft.num_blocks
    alone = ModelRunner(EngineConfig(model=model, device="cpu", kv_cache_memory=budget))
    assert alone.num_blocks == budget // alone.bytes_per_block > llm.runner.num_blocks


def test_structured_outputs_and_real_text(default_model, hf_reference):
    """The default model as its own draft model, on text that repeats and on JSON under a schema: greedy
    output is HF's (and the engine's without drafts), the JSON valid, and drafts kept."""
    from test_speculative import CARD, COPY_CARDS

    llm = LLM(default_model, num_kv_blocks=256, speculative_config=_draft(default_model))
    plain = LLM(default_model, num_kv_blocks=256)
    outputs = llm.generate(REPEATING, GREEDY)
    for prompt, out in zip(REPEATING, outputs):
        assert out.outputs[0].token_ids == hf_reference(default_model, llm.encode(prompt), 40), prompt
    kept, judged = _spec_counts(llm)
    assert kept >= 0.9 * judged > 0, (kept, judged)
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": CARD})
    before = llm.stats()
    got, expected = llm.generate(COPY_CARDS, params), plain.generate(COPY_CARDS, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert all(set(json.loads(o.outputs[0].text)) == {"name", "born", "city"} for o in got)
    assert _spec_counts(llm, before)[0] > 0
    llm.block_manager.check_all_free()


def test_an_abort_between_drafting_steps_frees_every_block(tiny_models):
    model = tiny_models["llama"]
    llm = LLM(model, num_kv_blocks=64, speculative_config=_draft(model))
    for i, prompt in enumerate(random_prompts(4, 10, 30, 512, seed=4)):
        llm.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for _ in range(4):
        llm.step()
    assert _spec_counts(llm)[1] > 0
    llm.abort("r1")
    llm.abort("r2")
    ended = {}
    while llm.has_unfinished():
        for delta in llm.step():
            if delta.finished:
                ended[delta.request_id] = delta.finish_reason
    assert ended == {"r0": "length", "r1": "abort", "r2": "abort", "r3": "length"}
    llm.block_manager.check_all_free()


@pytest.mark.parametrize("case, message", [
    ("other_tokenizer", "has a tokenizer other than the model's"),
    ("windowed", "every layer of .* attends within a sliding window"),
])
def test_what_is_refused(tiny_models, drafts, case, message):
    model = tiny_models["mistral" if case == "windowed" else "llama"]
    draft = drafts["other_tokenizer"] if case == "other_tokenizer" else tiny_models["llama"]
    with pytest.raises(ValueError, match=message):
        LLM(model, num_kv_blocks=64, speculative_config=_draft(draft))


@ON_A_GPU
def test_draft_model_on_a_gpu_beside_cuda_graphs(tiny_models, drafts):
    """On a GPU (float32, CUDA graphs, async scheduling): the CPU's greedy outputs with a draft model; an
    identical one's drafts kept; in bfloat16, the outputs of the engine without drafts."""
    model = tiny_models["llama"]
    prompts = _repeating_prompts(8, 512, seed=5)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model, num_kv_blocks=64).generate(prompts, params)]
    for draft in (model, drafts["near"]):
        llm = LLM(model, device="cuda", dtype="float32", num_kv_blocks=64, speculative_config=_draft(draft))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected, draft
        kept, judged = _spec_counts(llm)
        assert kept >= (0.95 if draft == model else 0.2) * judged > 0, (kept, judged)
        llm.block_manager.check_all_free()
    settings = dict(device="cuda", dtype="bfloat16", num_kv_blocks=64)
    plain = [o.outputs[0].token_ids for o in LLM(model, **settings).generate(prompts, params)]
    drafting = LLM(model, speculative_config=_draft(model), **settings)
    assert [o.outputs[0].token_ids for o in drafting.generate(prompts, params)] == plain
    assert drafting.runner.graphs.verify_replays > 0
    drafting.block_manager.check_all_free()


@pytest.fixture(scope="module")
def server():
    # The draft model's folder as model.json gives it: relative to the project root.
    draft = str((ROOT / "models" / "SmolLM2-135M-Instruct").relative_to(ROOT))
    yield from serve(speculative_config=_draft(draft), num_kv_blocks=128, kv_cache_memory=None, max_num_seqs=16)


@pytest.mark.server
def test_served_with_a_draft_model(server, reference):
    """Through tritonserver, streamed over gRPC: the texts of the engine without drafts; the final response
    counts the request's drafts, and the Prometheus counters the server's."""
    from grpc_stream import generate

    prompts = REPEATING[:3]
    expected = reference(prompts, 32)
    results = [generate(server.grpc_url, prompt, return_perf_metrics=True,
                        sampling_parameters=greedy(32)) for prompt in prompts]
    assert [r.text for r in results] == expected and all(r.error is None for r in results)
    final = results[0].responses[-1]
    drafted, kept = int(final["total_draft_tokens"][0]), int(final["total_accepted_draft_tokens"][0])
    assert 0 < kept <= drafted and kept >= 0.9 * drafted
    server.wait_for_metric("inflight_spec_decode_num_accepted_tokens_total", lambda v: v >= kept)
    assert_all_blocks_free(server)
    deadline = time.monotonic() + 10  # (the last report's counters, sent one after another)
    while True:
        total = server.metrics()["inflight_spec_decode_num_accepted_tokens_total"]
        by_position = server.labeled("inflight_spec_decode_num_accepted_tokens_per_pos", "position")
        if sum(by_position.values()) == total or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(by_position) == {"0", "1", "2", "3"} and sum(by_position.values()) == total, (by_position, total)
