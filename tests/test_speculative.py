"""Speculative decoding by n-gram lookup: the lookup, the rejection sampling's distribution, greedy
output equal to HF transformers' and to the engine without drafts (beside requests that cannot
speculate, under preemption, a small token budget and the prefix cache), aborts, and served through
tritonserver with its metrics; drafts given with a request (TensorRT-LLM's draft_input_ids) judged
with its prompt's end, one step at a time and pipelined, offline and served."""

import dataclasses
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import assert_all_blocks_free, concurrently, graphs_on_a_cpu, serve
from inflight import LLM, SamplingParams
from inflight.config import EngineConfig
from inflight.sampler import filter_probs
from inflight.speculative import accepted_tokens, lookup, verify

SPEC = {"num_speculative_tokens": 4}


@pytest.mark.parametrize("settings, message", [
    (dict(speculative_config={"method": "eagle", "num_speculative_tokens": 2}), 'is not served: "ngram"'),
    (dict(speculative_config={"prompt_lookup_max": 3}), "needs num_speculative_tokens"),
    (dict(speculative_config={"num_speculative_tokens": 0}), "num_speculative_tokens must be a positive integer"),
    (dict(speculative_config={"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}),
     r"prompt_lookup_min \(5\) exceeds prompt_lookup_max \(3\)"),
    (dict(speculative_config={"num_speculative_tokens": 2, "draft_model": "x"}), "unknown speculative_config key"),
    (dict(speculative_config="ngram"), "must be an object"),
])
def test_the_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="unused", device="cpu", **settings)


def test_one_lookup_bound_fits_the_other():
    only_min = EngineConfig(model="unused", device="cpu", speculative_config={"num_speculative_tokens": 3,
                                                                              "prompt_lookup_min": 6})
    only_max = EngineConfig(model="unused", device="cpu", speculative_config={"num_speculative_tokens": 3,
                                                                              "prompt_lookup_max": 1})
    assert (only_min.speculative_config.prompt_lookup_min, only_min.speculative_config.prompt_lookup_max) == (6, 6)
    assert (only_max.speculative_config.prompt_lookup_min, only_max.speculative_config.prompt_lookup_max) == (1, 1)
    assert not EngineConfig(model="unused", device="cpu", speculative_config=SPEC).async_scheduling  # (a CPU's)


def test_lookup_takes_the_longest_then_latest_match():
    tokens = np.array([5, 1, 2, 3, 4, 9, 2, 3, 8, 7, 1, 2, 3])
    assert lookup(tokens, 2, 4, 3) == [4, 9, 2]  # "1 2 3" (3 tokens) beats the later "2 3"
    assert lookup(tokens, 2, 2, 3) == [8, 7, 1]  # at most 2 tokens: the latest "2 3"
    assert lookup(tokens, 4, 4, 3) == []  # "7 1 2 3" never came before
    assert lookup(np.array([1, 2, 1, 2]), 2, 4, 5) == [1, 2]  # what follows, up to the end
    assert lookup(np.array([1, 2, 3, 4]), 1, 4, 5) == []
    assert lookup(np.array([7, 7]), 2, 4, 5) == []  # too short for the shortest n-gram


def _judged(params: SamplingParams, logits: torch.Tensor, drafts: list[int], count: int, seed: int = 0):
    """`count` sequences with the same rows (`logits`, one more than `drafts`) judged together: the
    tokens each keeps."""
    torch.manual_seed(seed)
    rows = len(drafts) + 1
    seq = SimpleNamespace(params=params, generator=None)
    tokens = verify(logits.repeat(count, 1), [seq] * (rows * count), [*drafts, -1] * count).view(count, rows)
    return [accepted_tokens(row, drafts) for row in tokens.tolist()]


def _target(params: SamplingParams, row: torch.Tensor) -> np.ndarray:
    probs = filter_probs(row[None].clone(), [SimpleNamespace(params=params)])[0]
    return (probs / probs.sum()).numpy()


def _frequencies(tokens: list[int], vocab: int) -> np.ndarray:
    return np.bincount(tokens, minlength=vocab) / max(len(tokens), 1)


ON_A_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_A_GPU)], ids=["cpu", "gpu"])


@DEVICES
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(top_p=0.8, min_p=0.1), SamplingParams(min_p=0.5)],
                         ids=["plain", "top-k", "top-p-min-p", "min-p"])  # (min-p: a third of the mass dropped)
def test_kept_tokens_follow_the_model_distribution(params, device):
    """Rejection sampling against a one-hot proposal: the first kept token is distributed as the first
    row's probabilities whatever the draft, and each next one (after a kept draft) as its own row's."""
    vocab, count = 6, 30_000
    logits = torch.tensor([[1.0, 2.0, 0.5, 1.5, -1.0, 0.0],
                           [0.2, -0.5, 1.8, 1.0, 0.3, 0.9],
                           [2.0, 0.1, 0.3, -2.0, 1.2, 0.6]], device=device)
    drafts = [3, 5]  # a likely first draft, then one top-k and top-p may drop
    kept = _judged(params, logits, drafts, count)
    for depth in range(3):
        # the sequences whose drafts before this depth were all kept
        reached = [k for k in kept if len(k) > depth and k[:depth] == drafts[:depth]]
        if not reached:  # (only past a draft the filters drop)
            assert _target(params, logits[depth - 1].cpu())[drafts[depth - 1]] == 0
            break
        observed = _frequencies([k[depth] for k in reached], vocab)
        expected = _target(params, logits[depth].cpu())
        tolerance = 5 * np.sqrt(0.25 / len(reached))  # five standard deviations of the worst frequency
        assert np.abs(observed - expected).max() < tolerance, (depth, observed, expected)
    if _target(params, logits[1].cpu())[drafts[1]] == 0:  # a draft the filters drop is never kept
        assert not any(len(k) > 1 and k[1] == drafts[1] for k in kept)


@DEVICES
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)],
                         ids=["plain", "top-k"])
def test_drafts_drawn_from_a_draft_model_keep_the_model_distribution(params, device):
    """A draft model's drafts (TensorRT-LLM's draft_logits): each trial draws its drafts from the draft
    model's rows q, each row keeps its draft with probability min(1, p/q), else draws from max(0, p - q):
    the kept tokens are distributed as the model's rows p at each depth, and a draft is kept as often as
    sum(min(p, q)) says (against a one-hot proposal the output would still be p's, but fewer drafts
    kept: sum(p q))."""
    vocab, count = 6, 30_000
    logits = torch.tensor([[1.0, 2.0, 0.5, 1.5, -1.0, 0.0],
                           [0.2, -0.5, 1.8, 1.0, 0.3, 0.9],
                           [2.0, 0.1, 0.3, -2.0, 1.2, 0.6]], device=device)
    q = torch.softmax(torch.tensor([[0.0, -1.0, 2.0, 1.0, 0.5, 1.5],
                                    [1.0, 2.0, -1.0, 0.0, 0.0, 1.0]]), dim=-1).numpy()
    rng = np.random.default_rng(5)
    drafts = np.stack([rng.choice(vocab, size=count, p=q[i] / q[i].sum()) for i in range(2)], axis=1).tolist()
    torch.manual_seed(0)
    seq = SimpleNamespace(params=params, generator=None)
    tokens = verify(logits.repeat(count, 1), [seq] * (3 * count), [t for d in drafts for t in (*d, -1)],
                    [*q, None] * count).view(count, 3).tolist()
    kept = [accepted_tokens(row, d) for row, d in zip(tokens, drafts)]
    for depth in range(3):
        # the trials whose drafts before this depth were all kept: (tokens kept, drafts)
        reached = [(k, d) for k, d in zip(kept, drafts) if len(k) > depth and k[:depth] == d[:depth]]
        observed = _frequencies([k[depth] for k, _ in reached], vocab)
        expected = _target(params, logits[depth].cpu())
        tolerance = 5 * np.sqrt(0.25 / len(reached))
        assert np.abs(observed - expected).max() < tolerance, (depth, observed, expected)
        if depth < 2:
            kept_rate = np.mean([k[depth] == d[depth] for k, d in reached])
            assert abs(kept_rate - np.minimum(expected, q[depth]).sum()) < tolerance, depth
            assert abs(kept_rate - (expected * q[depth]).sum()) > 3 * tolerance  # (the test can tell them apart)


def test_a_seeded_judgement_repeats():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=7)
    judged = []
    for _ in range(2):
        seq = SimpleNamespace(params=params, generator=torch.Generator().manual_seed(7))
        judged.append(verify(logits.clone(), [seq] * 3, [4, 9, -1]).tolist())
    assert judged[0] == judged[1]


def test_greedy_rows_keep_drafts_equal_to_their_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    seq = SimpleNamespace(params=SamplingParams(temperature=0), generator=None)
    tokens = verify(logits.clone(), [seq] * 3, [1, 0, -1]).tolist()
    assert tokens == [1, 0, 2] and accepted_tokens(tokens, [1, 0]) == [1, 0, 2]
    tokens = verify(logits.clone(), [seq] * 3, [1, 2, -1]).tolist()
    assert accepted_tokens(tokens, [1, 2]) == [1, 0]  # the second draft lost to the argmax: it ends there


# -- the engine ------------------------------------------------------------------------------------
REPEATING = [
    "Repeat this sentence three times: The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "Count: one, two, three, four, five, six, seven,",
    "Copy the list: apples, pears, plums, cherries, figs.\nCopy:",
]


def _results(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]


@pytest.fixture(scope="module")
def engines(default_model):
    """The default model with drafts of up to 4 tokens, and without."""
    return LLM(default_model, num_kv_blocks=256, speculative_config=SPEC), LLM(default_model, num_kv_blocks=256)


def test_greedy_output_equals_hf_and_the_engine_without_drafts(engines, default_model, hf_reference):
    """Real weights and text that repeats: drafts are kept and rejected, and every greedy output is
    HF's token for token; beside them requests that cannot speculate (penalties, bad words), one with
    logprobs, token controls, a stop string and a short max_tokens end as the engine without drafts ends
    them."""
    drafting, plain = engines
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ret, four = (drafting.encode(word, add_special_tokens=False)[0] for word in (" return", " four"))
    counting = set(drafting.encode(REPEATING[2], add_special_tokens=False))
    requests = [(prompt, greedy) for prompt in REPEATING] + [
        (REPEATING[0], SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3)),
        (REPEATING[1], SamplingParams(temperature=0, max_tokens=30, bad_words=["return"])),
        (REPEATING[2], SamplingParams(temperature=0, max_tokens=30, logprobs=3)),
        # token controls judge the drafts too: a word the prompt offers and the model would write banned,
        # tokens limited to some
        (REPEATING[1], SamplingParams(temperature=0, max_tokens=30, logit_bias={ret: -100.0})),
        (REPEATING[2], SamplingParams(temperature=0, max_tokens=30, allowed_token_ids=sorted(counting - {four}))),
        (REPEATING[0], SamplingParams(temperature=0, max_tokens=60, stop=["clauses"])),
        (REPEATING[3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
        (REPEATING[3], SamplingParams(temperature=0, max_tokens=60)),
    ]
    prompts, params = [p for p, _ in requests], [p for _, p in requests]
    before = drafting.stats()
    got, expected = drafting.generate(prompts, params), plain.generate(prompts, params)
    stats = drafting.stats()
    drafted = stats["spec_decode_draft_tokens_total"] - before["spec_decode_draft_tokens_total"]
    kept = stats["spec_decode_accepted_tokens_total"] - before["spec_decode_accepted_tokens_total"]
    assert 0 < kept < drafted, (kept, drafted)
    assert _results(got) == _results(expected)
    for prompt, out in zip(REPEATING, got):
        assert out.outputs[0].token_ids == hf_reference(default_model, drafting.encode(prompt), 40), prompt
    assert len(got[-2].outputs[0].token_ids) == 5
    assert ret not in got[7].outputs[0].token_ids and set(got[8].outputs[0].token_ids) <= counting - {four}
    assert got[-3].outputs[0].finish_reason == "stop" and got[-3].outputs[0].text.endswith("separate the two ")
    for a, b in zip(got[6].outputs[0].logprobs, expected[6].outputs[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    drafting.block_manager.check_all_free()


def test_sampled_drafts_are_kept_and_a_seed_repeats(engines):
    drafting, _ = engines
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=3, n=2, ignore_eos=True)
    before = drafting.stats()["spec_decode_accepted_tokens_total"]
    first, again = (drafting.generate([REPEATING[0]], params)[0] for _ in range(2))
    assert drafting.stats()["spec_decode_accepted_tokens_total"] > before
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids  # seed + index: completions of their own
    drafting.block_manager.check_all_free()


CARD = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                         "city": {"type": "string"}},
        "required": ["name", "born", "city"], "additionalProperties": False}
COPY_CARDS = ['Copy this record as JSON: {"name": "Ada Lovelace", "born": 1815, "city": "London"}\nJSON: ',
              'Records: {"name": "Alan Turing", "born": 1912, "city": "London"} and {"name": "Grace Hopper", '
              '"born": 1906, "city": "New York"}. The second one as JSON: ']


def test_structured_outputs_draft_under_their_grammar(engines):
    """A JSON schema beside n-gram drafts: each row is masked to what the grammar allows after the drafts
    before it, so drafts that quote the prompt are kept, and the greedy output is the engine's without
    drafts (valid JSON); given drafts too, one of them one the grammar refuses."""
    drafting, plain = engines
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json": CARD})
    before = drafting.stats()["spec_decode_accepted_tokens_total"]
    got, expected = drafting.generate(COPY_CARDS, params), plain.generate(COPY_CARDS, params)
    assert _results(got) == _results(expected)
    assert all(json.loads(out.outputs[0].text)["born"] > 1800 for out in got)
    assert drafting.stats()["spec_decode_accepted_tokens_total"] - before > 10
    right = expected[0].outputs[0].token_ids
    refused = drafting.encode("}", add_special_tokens=False)[0]  # (a JSON object cannot close at its start)
    for drafts in (right[:5], right[:2] + [refused] + right[3:5]):
        given = SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json": CARD}, draft_token_ids=drafts)
        assert _results(plain.generate([COPY_CARDS[0]], given)) == _results(expected[:1])
    drafting.block_manager.check_all_free()
    plain.block_manager.check_all_free()


def test_an_abort_between_drafting_steps_frees_every_block(engines):
    """Blocks taken for drafts that were rejected come back with the rest."""
    drafting, _ = engines
    before = drafting.stats()
    drafting.add_request("spec-abort", REPEATING[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    rejected = 0
    while rejected == 0:
        assert drafting.step() and drafting.has_unfinished(), "the request ended without a rejected draft"
        stats = drafting.stats()
        rejected = (stats["spec_decode_draft_tokens_total"] - before["spec_decode_draft_tokens_total"]
                    - stats["spec_decode_accepted_tokens_total"] + before["spec_decode_accepted_tokens_total"])
    drafting.abort("spec-abort")
    deltas = drafting.step()
    assert [d.finish_reason for d in deltas if d.request_id == "spec-abort"] == ["abort"]
    assert not drafting.has_unfinished()
    drafting.block_manager.check_all_free()


def test_a_final_only_drafting_request_comes_in_one_delta(engines):
    """Steps that keep drafts add several tokens at once to a final-only request (LLM.generate's), with
    no delta; its one delta at the end is the same request's streamed deltas joined."""
    drafting, _ = engines
    before = drafting.stats()["spec_decode_accepted_tokens_total"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    drafting.add_request("final", REPEATING[1], params, final_only=True)
    drafting.add_request("streamed", REPEATING[1], params)
    deltas = {"final": [], "streamed": []}
    while drafting.has_unfinished():
        for d in drafting.step():
            deltas[d.request_id].append(d)
    assert drafting.stats()["spec_decode_accepted_tokens_total"] > before
    (final,) = deltas["final"]
    assert final.finished and final.new_token_ids == [t for d in deltas["streamed"] for t in d.new_token_ids]
    assert final.new_text == "".join(d.new_text for d in deltas["streamed"])
    drafting.block_manager.check_all_free()


def _repeating_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    """Token-id prompts made of a segment said three times, then a tail: lookups find drafts."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        segment = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 10))]
        prompts.append(segment * 3 + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))] + segment[:2])
    return prompts


def test_preemption_a_small_budget_and_the_prefix_cache(tiny_models, hf_reference):
    """A tight pool (sequences preempted and recomputed), a budget smaller than the drafts wanted, and
    the same prompts again (their blocks found in the prefix cache): every output is HF's."""
    model = tiny_models["llama"]
    prompts = _repeating_prompts(8, 512, seed=5)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm = LLM(model, num_kv_blocks=20, max_num_seqs=8, max_num_batched_tokens=16,
              speculative_config={"num_speculative_tokens": 6, "prompt_lookup_min": 1})
    expected = [hf_reference(model, prompt, 48) for prompt in prompts]
    for round_ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected, round_
        llm.block_manager.check_all_free()
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert 0 < stats["spec_decode_accepted_tokens_total"] < stats["spec_decode_draft_tokens_total"]


def _run_capped(llm, prompt, params, steps: int = 40) -> tuple[dict, dict, np.ndarray | None]:
    """Each completion's tokens and finish reason, and the context logits, stepping at most `steps` times
    (a stranded completion would keep generate() waiting forever)."""
    llm.add_request("r", prompt, params)
    tokens, ends, context = {}, {}, None
    for _ in range(steps):
        for d in llm.step():
            tokens[d.index] = tokens.get(d.index, []) + d.new_token_ids
            ends[d.index] = d.finish_reason
            context = d.context_logits if d.context_logits is not None else context
        if not llm.has_unfinished():
            return tokens, ends, context
    raise AssertionError(f"unfinished after {steps} steps: {tokens}")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-at-a-time", "pipelined"])
def test_a_prompt_end_drafts_only_for_its_own_next_token(tiny_models, hf_reference, async_scheduling):
    """A prompt whose last chunk is its last token alone, the end of a repeated segment: that chunk is
    scheduled like a decode, and drafts from there are judged with it. Not where its row is more than
    the sequence's own next token: with n = 2 both completions draw their first token from it (drafts
    there once stranded the second completion, never scheduled again), and with context logits it is
    their last row (drafts there once dropped it). A plain request still drafts from its prompt's end."""
    model = tiny_models["llama"]
    prompt = list(range(5, 15)) * 3  # a budget of 29 leaves the 30th token a chunk of its own
    settings = dict(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=29, async_scheduling=async_scheduling,
                    enable_prefix_caching=False)  # (every run computes its prompt as 29 tokens, then 1)
    llm = LLM(model, speculative_config={"num_speculative_tokens": 3}, **settings)
    greedy = hf_reference(model, prompt, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    schedule, drafts_scheduled = llm.scheduler.schedule, []

    def recording_schedule():
        batch = schedule()
        drafts_scheduled.append([len(seq.drafts) for seq in batch.seqs])
        return batch

    llm.scheduler.schedule = recording_schedule
    for kind in (dict(n=2), dict(return_context_logits=True), {}):
        llm.add_request("first steps", prompt, dataclasses.replace(params, **kind))
        for _ in range(2):  # the first 29 prompt tokens, then the last
            llm.step()
        llm.abort("first steps")
        llm.step()
    assert drafts_scheduled[1::3] == [[0], [0], [3]]  # the steps of the prompts' last tokens
    tokens, ends, _ = _run_capped(llm, prompt, dataclasses.replace(params, n=2))
    assert tokens == {0: greedy, 1: greedy} and ends == {0: "length", 1: "length"}
    tokens, ends, _ = _run_capped(llm, prompt, SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=3,
                                                                 ignore_eos=True))
    assert sorted(map(len, tokens.values())) == [8, 8] and ends == {0: "length", 1: "length"}
    tokens, _, context = _run_capped(llm, prompt, dataclasses.replace(params, return_context_logits=True))
    _, _, expected = _run_capped(LLM(model, **settings), prompt,
                                 dataclasses.replace(params, return_context_logits=True))
    assert tokens == {0: greedy} and context.shape == (len(prompt), 512)
    np.testing.assert_allclose(context, expected, atol=1e-5, rtol=1e-5)
    llm.block_manager.check_all_free()


def test_async_scheduling_pipelines_large_batches_and_drafts_for_small_ones(tiny_models, hf_reference):
    """n-gram drafts under async scheduling: while disable_by_batch_size or more sequences decode, steps
    pipeline without drafts; once fewer do, the step in flight is read first and each sequence proposes
    from its latest token. Every output is HF's."""
    model = tiny_models["llama"]
    prompts = _repeating_prompts(8, 512, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=12 if i % 2 else 40, ignore_eos=True) for i in range(8)]
    llm = LLM(model, num_kv_blocks=64, async_scheduling=True,
              speculative_config={"num_speculative_tokens": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 5})
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == hf_reference(model, prompt, p.max_tokens)
    assert llm.num_pipelined_steps > 5, "steps of 8 decoding sequences were meant to pipeline"
    assert llm.stats()["spec_decode_accepted_tokens_total"] > 0, "the 4 left were meant to draft"
    llm.block_manager.check_all_free()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-at-a-time", "pipelined"])
def test_steps_verifying_drafts_replay_graphs_of_padded_sequences(tiny_models, hf_reference, async_scheduling):
    """On a GPU a step whose sequences have at most num_speculative_tokens + 1 tokens (a last token and its
    drafts, or a decode beside them) replays a graph of that many tokens a sequence, each sequence padded
    after its tokens and the batch with padding sequences (cuda_graphs.uniform_step). Run here with the
    graphs' replays as eager forwards over the same buffers: every output is HF's, and the steps replayed
    had sequences of fewer tokens and batches of fewer sequences than their graph."""
    model = tiny_models["llama"]
    prompts = _repeating_prompts(7, 512, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=24 + 4 * i, ignore_eos=True) for i in range(7)]
    llm = LLM(model, num_kv_blocks=96, max_num_seqs=8, async_scheduling=async_scheduling,
              speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1})
    graphs = graphs_on_a_cpu(llm, max_tokens=0)  # (the steps with prompt chunks eager)
    assert graphs.verify_sizes == [1, 2, 4, 8] and graphs.verify_len == 4
    replay, replayed = graphs.replay, []

    def recording_replay(inputs, sampled=None):
        if graphs.covers(inputs):
            replayed.append(np.diff(inputs.cu_seqlens).tolist())
        return replay(inputs, sampled)

    graphs.replay = recording_replay
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == hf_reference(model, prompt, p.max_tokens)
    verified = [counts for counts in replayed if max(counts) > 1]
    assert graphs.verify_replays == len(verified) > 0 and graphs.ragged_replays == 0
    assert any(min(counts) < max(counts) for counts in verified), "a sequence was meant to be padded"
    assert any(len(counts) not in graphs.verify_sizes for counts in verified), "a batch was meant to be padded"
    assert llm.stats()["spec_decode_accepted_tokens_total"] > 0
    llm.block_manager.check_all_free()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted on a CPU; on a GPU the bfloat16 drafting test")
def test_the_triton_attention_is_told_a_verify_steps_query_length(tiny_models, hf_reference, monkeypatch):
    """Through the Triton kernels (interpreted here): a step verifying drafts replayed from its graph tells
    the attention its sequences' one query length (16-bit, it then splits their contexts as a decode
    batch's: test_kernels.py); every other step, none. Outputs are HF's."""
    from inflight.ops import triton_ops

    monkeypatch.setenv("INFLIGHT_ATTENTION", "triton")
    told, attend = [], triton_ops.paged_attention

    def recording(*args, query_len=None, **kwargs):
        told.append(query_len)
        return attend(*args, query_len=query_len, **kwargs)

    monkeypatch.setattr(triton_ops, "paged_attention", recording)
    model = tiny_models["llama"]
    prompts = _repeating_prompts(3, 512, seed=4)
    llm = LLM(model, num_kv_blocks=64, max_num_seqs=4, speculative_config={"num_speculative_tokens": 2,
                                                                          "prompt_lookup_min": 1})
    assert llm.runner.attention_impl == "triton"
    graphs = graphs_on_a_cpu(llm, max_tokens=0)
    told.clear()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(model, p, 12) for p in prompts]
    layers = llm.runner.num_layers
    assert graphs.verify_replays > 0 and told.count(3) == layers * graphs.verify_replays
    assert set(told) == {None, 3}


@ON_A_GPU
def test_drafts_on_a_gpu_beside_cuda_graphs(tiny_models):
    """On a GPU (float32, CUDA graphs for decode steps and those verifying drafts, async scheduling on by
    default): the CPU's greedy outputs, with n-gram drafts, and with drafts given with the requests; in
    bfloat16, the outputs without drafts."""
    model = tiny_models["llama"]
    prompts = _repeating_prompts(8, 512, seed=5)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model, num_kv_blocks=64).generate(prompts, params)]
    llm = LLM(model, device="cuda", dtype="float32", num_kv_blocks=64,
              speculative_config={"num_speculative_tokens": 4, "prompt_lookup_min": 1})
    assert llm.config.async_scheduling
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.stats()["spec_decode_accepted_tokens_total"] > 0
    assert llm.runner.graphs.verify_replays > 0, "steps verifying drafts were meant to replay graphs"
    llm.block_manager.check_all_free()
    # bfloat16: the steps verifying drafts split their contexts (triton_ops.verify_steps_split);
    # the tokens of the same engine without drafts (the tiny models' logits are peaked: rounding alone does
    # not flip them, as test_graphs_equal_eager_in_bfloat16 relies on too)
    settings = dict(device="cuda", dtype="bfloat16", num_kv_blocks=64)
    plain = [o.outputs[0].token_ids for o in LLM(model, **settings).generate(prompts, params)]
    drafting = LLM(model, speculative_config={"num_speculative_tokens": 4, "prompt_lookup_min": 1}, **settings)
    assert [o.outputs[0].token_ids for o in drafting.generate(prompts, params)] == plain
    assert drafting.runner.graphs.verify_replays > 0
    drafting.block_manager.check_all_free()
    pipelined = LLM(model, device="cuda", dtype="float32", num_kv_blocks=64)
    assert pipelined.config.async_scheduling
    given = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                            draft_token_ids=tokens[:3] + [(tokens[3] + 1) % 512]) for tokens in expected]
    assert [o.outputs[0].token_ids for o in pipelined.generate(prompts, given)] == expected
    assert pipelined.stats()["spec_decode_accepted_tokens_total"] == 3 * len(prompts)
    pipelined.block_manager.check_all_free()


# -- drafts given with the request (TensorRT-LLM's draft_input_ids) ------------------------------------
def _first_tokens(llm: LLM, request_id: str, prompt, params: SamplingParams) -> tuple[list[int], list[int]]:
    """The tokens of the request's first delta with tokens, and all its tokens."""
    llm.add_request(request_id, prompt, params)
    deltas = []
    while llm.has_unfinished():
        deltas += [d for d in llm.step() if d.request_id == request_id and d.new_token_ids]
    return deltas[0].new_token_ids, [t for d in deltas for t in d.new_token_ids]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-at-a-time", "pipelined"])
def test_given_drafts_are_judged_with_the_prompt(tiny_models, hf_reference, async_scheduling):
    """Drafts given with a request ride with its prompt's last chunk, without speculative_config: right
    ones all come out of that one step, a wrong one ends what is kept there, more than max_tokens
    allows are cut; every output is HF's, and the prompt is cached for the next."""
    model = tiny_models["llama"]
    llm = LLM(model, num_kv_blocks=64, async_scheduling=async_scheduling)
    prompt = random.Random(3).sample(range(3, 512), 20)
    expected = hf_reference(model, prompt, 16)
    greedy = dict(temperature=0, max_tokens=16, ignore_eos=True)
    first, tokens = _first_tokens(llm, "right", prompt, SamplingParams(draft_token_ids=expected[:6], **greedy))
    assert first == expected[:7] and tokens == expected
    wrong = expected[:2] + [(expected[2] + 1) % 512] + expected[3:6]
    first, tokens = _first_tokens(llm, "wrong", prompt, SamplingParams(draft_token_ids=wrong, **greedy))
    assert first == expected[:3] and tokens == expected
    cut = dict(greedy, max_tokens=3)
    first, tokens = _first_tokens(llm, "cut", prompt, SamplingParams(draft_token_ids=expected[:6], **cut))
    assert first == tokens == expected[:3]
    stats = llm.stats()
    judged = stats["spec_decode_draft_tokens_total"], stats["spec_decode_accepted_tokens_total"]
    assert judged == (6 + 6 + 2, 6 + 2 + 2)
    assert stats["prefix_cache_hit_tokens"] > 0
    sampled = llm.generate([prompt], SamplingParams(draft_token_ids=expected[:6], temperature=1.0, max_tokens=16,
                                                    ignore_eos=True, seed=1))[0]
    assert len(sampled.outputs[0].token_ids) == 16
    llm.block_manager.check_all_free()


@pytest.mark.parametrize("values, message", [
    (dict(n=2), "n is not supported with draft_token_ids"),
    (dict(repetition_penalty=1.2), "repetition_penalty is not supported with draft_token_ids"),
    (dict(bad_words=["x"]), "bad_words is not supported with draft_token_ids"),
    (dict(min_tokens=2), "min_tokens is not supported with draft_token_ids"),
    (dict(beam_width=2, temperature=0), "beam_width is not supported with draft_token_ids"),
    (dict(return_context_logits=True), "return_context_logits is not supported with draft_token_ids"),
    (dict(draft_token_ids=[-1]), "draft_token_ids must hold non-negative integer token ids"),
    (dict(draft_token_ids=[1] * 65), "at most 64 are judged"),
])
def test_given_drafts_refuse_what_a_row_cannot_judge_alone(values, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{"draft_token_ids": [5, 6], **values})


def test_given_drafts_with_a_draft_models_logits(tiny_models, hf_reference):
    """draft_logits beside given drafts: greedy output unchanged (HF's), sampled output repeated by its
    seed; logits that do not fit the drafts or the model are refused by name."""
    model = tiny_models["llama"]
    llm = LLM(model, num_kv_blocks=64)
    prompt = random.Random(4).sample(range(3, 512), 20)
    expected = hf_reference(model, prompt, 16)
    drafts = expected[:2] + [(expected[2] + 1) % 512, expected[3]]
    logits = np.random.default_rng(0).normal(size=(4, 512)).astype(np.float32)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, draft_token_ids=drafts,
                            draft_logits=logits)
    first, tokens = _first_tokens(llm, "greedy", prompt, greedy)
    assert first == expected[:3] and tokens == expected
    sampled = SamplingParams(temperature=1.0, seed=2, max_tokens=16, ignore_eos=True, draft_token_ids=drafts,
                             draft_logits=logits)
    outs = [llm.generate([prompt], sampled)[0].outputs[0].token_ids for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 16
    with pytest.raises(ValueError, match="draft_logits rows have 100 entries; the model's vocabulary has 512"):
        llm.add_request("narrow", prompt, SamplingParams(draft_token_ids=drafts, draft_logits=logits[:, :100]))
    for values, message in ((dict(draft_logits=logits), "draft_logits need draft_token_ids"),
                            (dict(draft_token_ids=drafts[:3], draft_logits=logits), "a row for each of the 3"),
                            (dict(draft_token_ids=drafts, draft_logits=np.where(np.arange(512) == drafts[1], -np.inf,
                                                                                logits)),
                             "draft 1 has no probability"),
                            (dict(draft_token_ids=drafts, draft_logits=logits * np.nan), "finite")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**values)
    assert not llm.has_unfinished()
    llm.block_manager.check_all_free()


def test_given_drafts_beyond_the_vocabulary_are_refused(tiny_models):
    llm = LLM(tiny_models["llama"], num_kv_blocks=16)
    with pytest.raises(ValueError, match="draft_token_ids holds token ids beyond the vocabulary of 512"):
        llm.add_request("beyond", [5, 6, 7], SamplingParams(draft_token_ids=[4, 600]))
    assert not llm.has_unfinished()


# -- served ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    # A small pool (64 blocks of 16 tokens), which the storm below keeps full.
    yield from serve(speculative_config=SPEC, num_kv_blocks=64, kv_cache_memory=None, max_num_seqs=32,
                     max_num_batched_tokens=256)


@pytest.mark.server
def test_served_with_drafts(server, engines):
    """Through tritonserver: the streamed text equals the engine's without drafts; the final response's
    perf metrics count the request's drafts, and the Prometheus counters the server's."""
    from grpc_stream import generate

    _, plain = engines
    expected = plain.generate([REPEATING[1]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    result = generate(server.grpc_url, REPEATING[1], return_perf_metrics=True,
                      sampling_parameters={"temperature": 0, "max_tokens": 40, "ignore_eos": True})
    assert result.error is None and result.text == expected.outputs[0].text
    final = result.responses[-1]
    drafted, kept = int(final["total_draft_tokens"][0]), int(final["total_accepted_draft_tokens"][0])
    assert 0 < kept <= drafted and final["acceptance_rate"][0] == pytest.approx(kept / drafted)
    server.wait_for_metric("inflight_spec_decode_num_accepted_tokens_total", lambda v: v >= kept)
    server.wait_for_metric("inflight_spec_decode_num_draft_tokens_total", lambda v: v >= drafted)
    assert_all_blocks_free(server)


@pytest.mark.server
def test_served_with_tensorrt_llm_draft_input_ids(server, engines):
    """TensorRT-LLM's draft-target flow: input_ids and a draft model's draft_input_ids (and draft_logits)
    in, the tokens the target keeps out (here: two right drafts, then a wrong one)."""
    from grpc_stream import generate

    _, plain = engines
    prompt_ids = plain.encode(REPEATING[2])
    expected = plain.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    right = expected.outputs[0].token_ids
    drafts = right[:2] + [(right[2] + 1) % 1000, right[3]]
    result = generate(server.grpc_url, None, input_ids=np.array(prompt_ids, np.int32),
                      draft_input_ids=np.array(drafts, np.int32), max_tokens=8, temperature=0.0, ignore_eos=True,
                      return_perf_metrics=True)
    assert result.error is None
    assert [int(t) for r in result.responses for t in r["output_ids"]] == right
    final = result.responses[-1]
    assert (int(final["total_draft_tokens"][0]), int(final["total_accepted_draft_tokens"][0])) == (4, 2)
    both = generate(server.grpc_url, None, input_ids=np.array(prompt_ids, np.int32),
                    draft_input_ids=np.array(drafts, np.int32), sampling_parameters={"draft_token_ids": drafts})
    assert both.error and "not both" in both.error
    beyond = generate(server.grpc_url, None, input_ids=np.array(prompt_ids, np.int32),
                      draft_input_ids=np.array([10**6], np.int32))
    assert beyond.error and "beyond the vocabulary" in beyond.error
    # With the draft model's logits (TensorRT-LLM's draft_logits): greedy rows judge as before.
    vocab = plain.runner.hf_config.vocab_size
    logits = np.random.default_rng(1).normal(size=(4, vocab)).astype(np.float32)
    with_logits = generate(server.grpc_url, None, input_ids=np.array(prompt_ids, np.int32),
                           draft_input_ids=np.array(drafts, np.int32), draft_logits=logits, max_tokens=8,
                           temperature=0.0, ignore_eos=True, return_perf_metrics=True)
    assert with_logits.error is None
    assert [int(t) for r in with_logits.responses for t in r["output_ids"]] == right
    assert int(with_logits.responses[-1]["total_accepted_draft_tokens"][0]) == 2
    short = generate(server.grpc_url, None, input_ids=np.array(prompt_ids, np.int32),
                     draft_input_ids=np.array(drafts, np.int32), draft_logits=logits[:3])
    assert short.error and "a row for each of the 4 drafts" in short.error
    assert_all_blocks_free(server)


@pytest.mark.server
def test_served_cancellation_storm_with_drafts(server, engines):
    """32 drafting streams cancelled after a few responses, a third of them with drafts of their own,
    among drafting streams that must come out exact (two with drafts given, token ids in and out), in a
    small pool: every block back."""
    from grpc_stream import generate

    _, plain = engines
    greedy = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}
    expected = plain.generate(REPEATING, SamplingParams(**greedy))
    prompt_ids = [plain.encode(prompt) for prompt in REPEATING]
    rng = random.Random(9)
    results = {}

    def cancelled(i):
        endless = dict(greedy, max_tokens=300)
        if i % 3:
            results[i] = generate(server.grpc_url, REPEATING[i % 4], cancel_after=rng.randint(1, 6),
                                  sampling_parameters=endless)
        else:
            results[i] = generate(server.grpc_url, None, input_ids=np.array(prompt_ids[i % 4], np.int32),
                                  draft_input_ids=np.array(expected[i % 4].outputs[0].token_ids[:4], np.int32),
                                  cancel_after=rng.randint(1, 6), **endless)

    def survivor(i):
        if i < 2:
            results[f"s{i}"] = generate(server.grpc_url, REPEATING[i], sampling_parameters=greedy)
        else:
            results[f"s{i}"] = generate(server.grpc_url, None, input_ids=np.array(prompt_ids[i], np.int32),
                                        draft_input_ids=np.array(expected[i].outputs[0].token_ids[:4], np.int32),
                                        **greedy)

    calls = [lambda i=i: cancelled(i) for i in range(32)] + [lambda i=i: survivor(i) for i in range(4)]
    random.Random(10).shuffle(calls)
    with concurrently(calls, timeout=600):
        pass
    assert all(results[i].error == "cancelled" for i in range(32)), [results[i].error for i in range(32)]
    assert [results[f"s{i}"].text for i in range(2)] == [out.outputs[0].text for out in expected[:2]]
    for i in (2, 3):
        assert [int(t) for r in results[f"s{i}"].responses for t in r["output_ids"]] == expected[i].outputs[0].token_ids
    assert_all_blocks_free(server)

