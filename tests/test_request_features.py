"""Log probabilities (generated and prompt tokens) against HF transformers' own logits, several
completions per prompt, and priorities."""

import numpy as np
import pytest
import torch

from conftest import hf_greedy, random_prompts
from inflight import LLM, SamplingParams


# Steps one at a time, and under async scheduling (step N+1 launched before step N's tokens are read).
PIPELINED = pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-at-a-time", "pipelined"])


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def hf_logprobs(hf_tiny_llama):
    """log_softmax of HF's logits at every position of a token sequence (float32)."""
    def compute(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(hf_tiny_llama(torch.tensor([tokens])).logits[0].float(), dim=-1)

    return compute


def check_entry(entry: dict, reference: torch.Tensor, token: int, k: int) -> None:
    """One position's logprobs: the token's own value and rank, and the k most likely, within 1e-4."""
    assert token in entry
    assert abs(entry[token].logprob - reference[token].item()) < 1e-4
    assert entry[token].rank == int((reference > reference[token]).sum()) + 1
    top = reference.topk(k)
    for rank, (value, token_id) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        assert token_id in entry and abs(entry[token_id].logprob - value) < 1e-4
        if token_id != token:
            assert entry[token_id].rank == rank
    assert len(entry) in (k, k + 1)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_logprobs_equal_hf_log_softmax(model, hf_logprobs, temperature):
    """From the model's own distribution: temperature, penalties and filters do not change them."""
    llm = LLM(model, num_kv_blocks=64)
    prompts = random_prompts(4, 3, 30, vocab=512, seed=21)
    params = SamplingParams(max_tokens=8, temperature=temperature, top_k=20, repetition_penalty=1.3, seed=5,
                            logprobs=3, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        reference = hf_logprobs(prompt + out.token_ids)
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(out.token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, completion.logprobs)):
            check_entry(entry, reference[len(prompt) + i - 1], token, 3)
        assert abs(completion.cumulative_logprob - sum(e[t].logprob for t, e in zip(out.token_ids,
                                                                                     completion.logprobs))) < 1e-4
        assert all(isinstance(lp.decoded_token, str) for e in completion.logprobs for lp in e.values())


@PIPELINED
def test_prompt_logprobs_across_chunks_preemption_and_the_prefix_cache(model, hf_logprobs, async_scheduling):
    """Every prompt token after the first, also when the prompt is prefilled in chunks, recomputed
    after a preemption, or already in the prefix cache (which a request for them bypasses); under
    async scheduling they are read a step after their chunk ran, and no chunk is measured twice."""
    prompts = random_prompts(6, 20, 90, vocab=512, seed=22)
    params = SamplingParams(max_tokens=30, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    roomy = LLM(model, num_kv_blocks=256, async_scheduling=async_scheduling)
    tight = LLM(model, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=6, async_scheduling=async_scheduling)
    for llm in (roomy, tight):
        first = llm.generate(prompts, params)
        again = llm.generate(prompts[:2], params)  # the same prompts: their blocks are cached by now
        for prompt, out in [*zip(prompts, first), *zip(prompts[:2], again)]:
            reference = hf_logprobs(prompt)
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            for j in range(1, len(prompt)):
                check_entry(out.prompt_logprobs[j], reference[j - 1], prompt[j], 2)
        llm.block_manager.check_all_free()
        assert (llm.num_pipelined_steps > 0) == async_scheduling
    assert tight.stats()["num_preemptions"] > 0


# Each rewards what was seen (a tiny random model seldom repeats itself): the penalties decide the outputs.
PENALTIES = [dict(repetition_penalty=0.5), dict(presence_penalty=-2.0), dict(frequency_penalty=-1.5),
             dict(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=-0.5)]


@PIPELINED
def test_penalties_equal_hf_generate(model, hf_tiny_llama, async_scheduling):
    """Repetition (HF's), presence and frequency (vLLM's) penalties, greedy: every output HF's token for
    token, for requests batched together, whose tokens the penalties read from the device's record
    (token_history.py), with a pool small enough to preempt and recompute, prompts sharing blocks through
    the prefix cache (the same prompts again), and n completions forked from one prompt (their first
    tokens drawn from its row)."""
    prompts = random_prompts(6, 10, 70, vocab=512, seed=41)
    requests = [(prompt, PENALTIES[i % len(PENALTIES)]) for i, prompt in enumerate(prompts)]
    requests += [(prompts[0], PENALTIES[3]), (prompts[2], PENALTIES[1])]  # cached prompt blocks, other penalties
    # n completions of a prompt ending in a block it shares with them until each writes there (copied), a
    # strong reward for its tokens deciding theirs.
    forked = len(requests)
    requests.append((prompts[1][:29], dict(repetition_penalty=0.2)))
    llm = LLM(model, num_kv_blocks=24, block_size=8, max_num_seqs=8, max_num_batched_tokens=64,
              async_scheduling=async_scheduling)
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, **p) for _, p in requests]
    params[forked] = SamplingParams(n=3, max_tokens=20, temperature=0.0, ignore_eos=True, **requests[forked][1])
    outs = llm.generate([prompt for prompt, _ in requests], params)
    for (prompt, penalties), out in zip(requests, outs):
        expected = hf_greedy(hf_tiny_llama, prompt, 20, **penalties)
        assert [c.token_ids for c in out.outputs] == [expected] * len(out.outputs), penalties
    assert hf_greedy(hf_tiny_llama, prompts[0], 20) != outs[0].token_ids, "the penalty was meant to matter"
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
    assert (llm.num_pipelined_steps > 0) == async_scheduling
    llm.block_manager.check_all_free()


@PIPELINED
def test_context_and_generation_logits_equal_hfs_raw_logits(model, hf_tiny_llama, async_scheduling):
    """TensorRT-LLM's return_context_logits and return_generation_logits: the model's raw logits at every
    prompt position and for each generated token (sampled ones too: before temperature and penalties),
    HF's within 1e-4, across chunked prefill, preemption and the prefix cache (which they bypass), beside
    requests that ask for neither, with n completions and under beam search (each hypothesis's rows
    along its beams, a penalty changing none of them); too many of them refused up front."""
    prompts = random_prompts(8, 20, 90, vocab=512, seed=23)
    logits = dict(return_context_logits=True, return_generation_logits=True, ignore_eos=True, max_tokens=20)
    params = [SamplingParams(temperature=0.0, **logits), SamplingParams(max_tokens=20, temperature=0.0),
              SamplingParams(temperature=0.9, repetition_penalty=1.3, seed=1, n=2, **logits),
              SamplingParams(beam_width=3, n=2, repetition_penalty=1.3, **logits)] * 2
    roomy = LLM(model, num_kv_blocks=256, async_scheduling=async_scheduling)
    tight = LLM(model, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=6, async_scheduling=async_scheduling)
    for llm in (roomy, tight):
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # cached blocks of two prompts
        for prompt, p, out in zip(prompts, params, llm.generate(prompts, params)):
            if not p.return_context_logits:
                assert out.context_logits is None and out.outputs[0].generation_logits is None
                continue
            assert out.context_logits.shape == (len(prompt), 512)
            for completion in out.outputs:
                with torch.inference_mode():
                    reference = hf_tiny_llama(torch.tensor([prompt + completion.token_ids])).logits[0].float()
                assert np.allclose(out.context_logits, reference[:len(prompt)].numpy(), atol=1e-4)
                assert completion.generation_logits.shape == (20, 512)
                assert np.allclose(completion.generation_logits, reference[len(prompt) - 1:-1].numpy(), atol=1e-4)
        llm.block_manager.check_all_free()
    assert tight.stats()["num_preemptions"] > 0
    with pytest.raises(ValueError, match="logits of n x max_tokens generated tokens' 8000000 positions"):
        roomy.add_request("huge", [5, 6], SamplingParams(max_tokens=8_000_000, return_generation_logits=True))
    with pytest.raises(ValueError, match="logits of beam_width x max_tokens generated tokens' 16000000 positions"):
        roomy.add_request("huge beams", [5, 6], SamplingParams(beam_width=2, max_tokens=8_000_000,
                                                               return_generation_logits=True))


def _ngrams(tokens: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


@PIPELINED
def test_no_repeat_ngram_size_equals_hf_generate(model, hf_tiny_llama, async_scheduling):
    """HF's (and TensorRT-LLM's) no_repeat_ngram_size, the prompt's n-grams included: greedy output equal
    to HF generate's for sizes 1 to 3, beside requests without it, where the same prompts repeat
    themselves; sampled output never repeats an n-gram."""
    prompts = random_prompts(4, 5, 30, vocab=512, seed=31) + [[7, 8, 9] * 5]
    llm = LLM(model, num_kv_blocks=128, async_scheduling=async_scheduling)
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    repeating = [o.token_ids for o in llm.generate(prompts, plain)]
    assert any(len(set(_ngrams(p + t, 2))) < len(_ngrams(p + t, 2)) for p, t in zip(prompts, repeating))
    for size in (1, 2, 3):
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, no_repeat_ngram_size=size)
        outs = llm.generate(prompts * 2, [params] * len(prompts) + [plain] * len(prompts))
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                hf = hf_tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                            max_new_tokens=30, eos_token_id=None, pad_token_id=0,
                                            no_repeat_ngram_size=size)
            assert out.token_ids == hf[0, len(prompt):].tolist(), size
        assert [o.token_ids for o in outs[len(prompts):]] == repeating
    sampled = SamplingParams(temperature=1.0, seed=4, max_tokens=40, ignore_eos=True, no_repeat_ngram_size=2)
    for prompt, out in zip(prompts, llm.generate(prompts, sampled)):
        grams = _ngrams(prompt + out.token_ids, 2)
        first_new = len(prompt) - 1  # (the prompt may repeat itself: the output must not)
        assert all(gram not in grams[:i] for i, gram in enumerate(grams) if i >= first_new)
    llm.block_manager.check_all_free()


def test_a_tokens_rank_counts_the_tokens_strictly_likelier():
    """vLLM's rank: 1 + the tokens of a higher logprob, so tokens tied for the top are each rank 1."""
    from inflight.logprobs import measure

    logits = torch.tensor([[2.0, 2.0, 0.5, 3.0], [1.0, 1.0, 1.0, 0.0]])
    measured = measure(logits, torch.tensor([1, 2]), k=2)
    assert measured.ranks.tolist() == [2, 1]
    assert torch.allclose(measured.chosen, torch.log_softmax(logits, dim=-1)[[0, 1], [1, 2]])


def test_without_logprobs_nothing_is_computed(model):
    out = LLM(model, num_kv_blocks=64).generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None


def test_a_later_request_of_higher_priority_is_served_first(model):
    llm = LLM(model, num_kv_blocks=64, max_num_seqs=1)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    order = []
    for request_id, priority in (("low-1", 5), ("low-2", 5)):
        llm.add_request(request_id, [5, 6, 7], params, priority=priority)
    llm.step()  # low-1 is running
    llm.add_request("urgent", [8, 9], params, priority=0)
    while llm.has_unfinished():
        order += [d.request_id for d in llm.step() if d.finished]
    assert order == ["low-1", "urgent", "low-2"]


def recorded_preemptions(llm: LLM) -> list[str]:
    """The request ids of the sequences the scheduler of `llm` preempts from now on, in order."""
    preempted, real = [], llm.scheduler.preempt
    llm.scheduler.preempt = lambda seq: (preempted.append(seq.request_id), real(seq))[1]
    return preempted


def test_memory_pressure_preempts_the_lowest_priority_first(model):
    llm = LLM(model, num_kv_blocks=4, max_num_seqs=4, max_num_batched_tokens=64)  # 64 tokens for 2 x 43
    preempted = recorded_preemptions(llm)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm.add_request("background", [5, 6, 7], params, priority=9)  # first come, and still preempted first
    llm.add_request("important", [8, 9, 10], params, priority=-1)
    while llm.has_unfinished():
        llm.step()
    assert preempted and preempted[0] == "background" and "important" not in preempted
    llm.block_manager.check_all_free()


def test_a_running_request_of_low_priority_gives_way_to_a_later_one(model):
    """A running sequence that needs a block, when only a sequence of higher priority admitted after it
    could give one up, is preempted itself: the later request of higher priority keeps its blocks."""
    llm = LLM(model, num_kv_blocks=4, max_num_seqs=4, max_num_batched_tokens=64)
    preempted = recorded_preemptions(llm)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm.add_request("background", [5, 6, 7], params, priority=9)
    llm.step()  # running first, so it is first to need a block
    llm.add_request("important", [8, 9, 10], params, priority=-1)
    finished = []
    while llm.has_unfinished():
        finished += [d.request_id for d in llm.step() if d.finished]
    assert preempted and set(preempted) == {"background"} and finished == ["important", "background"]
    llm.block_manager.check_all_free()


def test_bad_priority_n_and_logprobs_are_refused(model):
    llm = LLM(model, num_kv_blocks=16)
    with pytest.raises(ValueError, match="priority"):
        llm.add_request("x", [5], SamplingParams(), priority="high")
    for bad, words in ((dict(n=0), "n must be at least 1"), (dict(n=65), "n must be at most 64"),
                       (dict(logprobs=21), "logprobs must be at most 20")):
        with pytest.raises(ValueError, match=words):
            SamplingParams(**bad)


PROMPT = list(range(5, 24))  # 19 tokens: the last prompt block is shared half-full, then copied on write


@PIPELINED
def test_n_greedy_completions_are_identical_and_the_prompt_is_computed_once(model, async_scheduling):
    # No prefix cache: every prompt token computed is counted.
    llm = LLM(model, num_kv_blocks=64, enable_prefix_caching=False, async_scheduling=async_scheduling)
    single = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    before = llm.stats()["computed_tokens_total"]
    out = llm.generate([PROMPT], SamplingParams(n=4, max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == single.token_ids and c.text == single.text for c in out.outputs)
    # The prompt once, then each completion's tokens after its first (drawn from the prompt's logits).
    assert llm.stats()["computed_tokens_total"] - before == len(PROMPT) + 4 * 9
    assert (llm.num_pipelined_steps > 0) == async_scheduling
    llm.block_manager.check_all_free()


@PIPELINED
def test_n_seeded_completions_reproduce_and_equal_separate_requests(model, async_scheduling):
    """Completion i draws with seed + i: it equals a separate request with that seed, which holds only
    if the shared and copied-on-write KV blocks are right."""
    llm = LLM(model, num_kv_blocks=64, async_scheduling=async_scheduling)
    params = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    out = llm.generate([PROMPT], SamplingParams(n=3, seed=7, **params))[0]
    again = llm.generate([PROMPT], SamplingParams(n=3, seed=7, **params))[0]
    separate = llm.generate([PROMPT] * 3, [SamplingParams(seed=7 + i, **params) for i in range(3)])
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs] == [
        o.token_ids for o in separate]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    llm.block_manager.check_all_free()


def test_n_completions_keep_their_seats_from_admission(model):
    """The completions a prompt will fork count against max_num_seqs from its admission: requests
    admitted beside it never leave a step with more sequences than max_num_seqs (before, that step
    failed every request in it)."""
    llm = LLM(model, num_kv_blocks=64, max_num_seqs=4)
    forking = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1)
    single = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    for params in ([forking] + [single] * 3, [single] * 3 + [forking]):  # it first, and after seats are taken
        outs = llm.generate([PROMPT[:6]] * 4, params)
        assert [len(out.outputs) for out in outs] == [p.n for p in params] and llm.num_failed_steps == 0
        assert all(c.finish_reason != "error" for out in outs for c in out.outputs)
        llm.block_manager.check_all_free()


@PIPELINED
def test_n_completions_under_preemption_and_abort(model, async_scheduling):
    params = SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    roomy = LLM(model, num_kv_blocks=128).generate([PROMPT, PROMPT[:9]], params)
    tight = LLM(model, num_kv_blocks=10, max_num_seqs=6, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    outs = tight.generate([PROMPT, PROMPT[:9]], params)
    assert tight.stats()["num_preemptions"] > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in roomy]
    tight.block_manager.check_all_free()
    tight.add_request("cancelled", PROMPT, SamplingParams(n=4, max_tokens=400, ignore_eos=True))
    for _ in range(3):
        tight.step()
    tight.abort("cancelled")
    deltas = tight.step()
    assert sorted(d.index for d in deltas) == [0, 1, 2, 3] and all(d.finish_reason == "abort" for d in deltas)
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
    tight.block_manager.check_all_free()
    # Cancelled before its prompt is computed (its completions not forked yet): it ends at once, whole.
    long_prompt = list(range(100, 180))  # (80 tokens, none cached: more than a step's 64)
    tight.add_request("cancelled early", long_prompt, SamplingParams(n=3, max_tokens=400, ignore_eos=True))
    tight.step()
    tight.abort("cancelled early")
    deltas = tight.step()
    assert [(d.index, d.finish_reason, d.finished) for d in deltas] == [(0, "abort", True)]
    assert not tight.has_unfinished()
    tight.block_manager.check_all_free()


@PIPELINED
def test_logit_bias_and_allowed_token_ids_equal_hf_generate(model, hf_tiny_llama, hf_logprobs, async_scheduling):
    """Greedy under logit_bias equals HF `generate` with the same bias on single tokens (its
    sequence_bias), under allowed_token_ids HF `generate` with a prefix_allowed_tokens_fn that allows
    the same; in one batch with requests that ask for neither, which stay as they were alone. A sampled
    request draws only allowed tokens, and its logprobs stay the model's own."""
    llm = LLM(model, num_kv_blocks=128, async_scheduling=async_scheduling)
    prompts = random_prompts(3, 5, 24, vocab=512, seed=31)
    greedy = dict(max_tokens=12, temperature=0.0)
    plain = llm.generate(prompts, SamplingParams(**greedy))
    bias = {plain[0].token_ids[0]: -30.0, 77: 4.0, 300: 2.5, 411: -1.0}
    allowed = [9, 40, 77, 150, 222, 300, 401, 509]  # not EOS (2): HF's generate would stop there
    outs = llm.generate([prompts[0], prompts[1], prompts[2], prompts[0]],
                        [SamplingParams(logit_bias=bias, **greedy), SamplingParams(allowed_token_ids=allowed, **greedy),
                         SamplingParams(**greedy),
                         SamplingParams(allowed_token_ids=allowed, max_tokens=40, temperature=1.0, seed=3,
                                        logprobs=0, ignore_eos=True)])

    def hf(prompt: list[int], **options) -> list[int]:
        with torch.inference_mode():
            ids = hf_tiny_llama.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, **options)
        return ids[0, len(prompt):].tolist()

    assert outs[0].token_ids == hf(prompts[0], sequence_bias={(t,): b for t, b in bias.items()})
    assert outs[0].token_ids != plain[0].token_ids
    assert outs[1].token_ids == hf(prompts[1], prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    assert set(outs[1].token_ids) <= set(allowed) and not set(plain[1].token_ids) <= set(allowed)
    assert outs[2].token_ids == plain[2].token_ids
    sampled = outs[3].outputs[0]
    assert set(sampled.token_ids) <= set(allowed) and len(set(sampled.token_ids)) > 2
    reference = hf_logprobs(prompts[0] + sampled.token_ids)
    for i, (token, entry) in enumerate(zip(sampled.token_ids, sampled.logprobs)):
        assert abs(entry[token].logprob - reference[len(prompts[0]) + i - 1, token].item()) < 1e-4
    llm.block_manager.check_all_free()


def test_token_controls_out_of_the_vocabulary_or_leaving_nothing_are_refused(model):
    llm = LLM(model, num_kv_blocks=32)
    cases = {"logit_bias": SamplingParams(logit_bias={512: 1.0}),
             "allowed_token_ids": SamplingParams(allowed_token_ids=[3, 600]),
             "min_tokens": SamplingParams(allowed_token_ids=[2, 7], stop_token_ids=[7], min_tokens=1)}
    for name, params in cases.items():
        with pytest.raises(ValueError, match=name):
            llm.add_request(name, [5, 6, 7], params)
    assert not llm.has_unfinished()


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(model):
    """The request runs as if its prompt were its last k tokens; -1 keeps max_model_len of them, so a
    prompt too long for the model is cut rather than refused."""
    llm = LLM(model, num_kv_blocks=64, max_model_len=256)
    prompt = random_prompts(1, 40, 40, vocab=512, seed=33)[0]
    params = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    cut, alone = llm.generate([prompt, prompt[-9:]], [SamplingParams(truncate_prompt_tokens=9, **params),
                                                     SamplingParams(**params)])
    assert cut.token_ids == alone.token_ids and cut.prompt_token_ids == prompt[-9:]
    whole = llm.generate([prompt], SamplingParams(truncate_prompt_tokens=100, **params))[0]
    assert whole.prompt_token_ids == prompt
    too_long = random_prompts(1, 300, 300, vocab=512, seed=34)[0]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([too_long], SamplingParams(**params))
    out = llm.generate([too_long], SamplingParams(truncate_prompt_tokens=-1, max_tokens=1, ignore_eos=True))[0]
    assert out.prompt_token_ids == too_long[-256:] and out.finish_reason == "length"
    llm.block_manager.check_all_free()
