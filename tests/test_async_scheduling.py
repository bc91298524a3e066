"""Async scheduling (step N+1 launched before step N's tokens are read): the same outputs as steps taken
one at a time, whatever ends a request (EOS, stop strings, max_tokens, max_model_len, an abort while
its token is in flight), every block back; penalties and min_tokens pipeline (they count the token in
flight), and so do logprobs, grammars and bad words (n completions and prompt logprobs: in
test_request_features.py, both ways). On the CPU the pipelining changes nothing but the order of the
host's work, which is what these tests check; on a GPU it is what overlaps the host with the GPU."""

import json
import re

import pytest

from conftest import random_prompts
from inflight import LLM, SamplingParams

PHONE = r"[0-9]{3}-[0-9]{4}"
PROMPTS = ["In 1969, the first humans landed on", "The three primary colors are", "def fibonacci(n):",
           "Once upon a time", "The capital of France is", "List three fruits:"]


def engines(model, **settings):
    return (LLM(model, async_scheduling=False, **settings), LLM(model, async_scheduling=True, **settings))


def outputs(llm, prompts, params):
    return [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, params)]


@pytest.mark.slow
def test_every_way_to_finish_matches_one_step_at_a_time(default_model):
    params = [
        SamplingParams(max_tokens=40, temperature=0.0),  # EOS may end it
        SamplingParams(max_tokens=40, temperature=0.0, stop=[".", "\n"]),
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7),  # seeded: the same draws
        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),  # runs into max_model_len
    ]
    one_at_a_time, pipelined = engines(default_model, num_kv_blocks=256, max_num_seqs=8, max_model_len=48)
    assert outputs(pipelined, PROMPTS, params) == outputs(one_at_a_time, PROMPTS, params)
    assert pipelined.num_pipelined_steps > 0
    last = outputs(pipelined, PROMPTS[-1:], params[-1:])[0]
    assert last[2] == "length" and len(pipelined.encode(PROMPTS[-1])) + len(last[0]) == 48
    pipelined.block_manager.check_all_free()


def test_a_sequences_last_token_is_never_computed(tiny_models):
    """Pipelined, a sequence whose token in flight is its last (max_tokens, max_model_len) is not
    scheduled again: no step computes a token that nothing will read."""
    llm = LLM(tiny_models["llama"], async_scheduling=True, max_model_len=40)
    prompt = random_prompts(1, 12, 12, vocab=512, seed=5)[0]
    for params, generated in ((SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), 5),
                              (SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), 40 - 12)):
        before = llm.stats()["computed_tokens_total"]
        assert len(llm.generate([prompt], params)[0].token_ids) == generated
        assert llm.stats()["computed_tokens_total"] - before == len(prompt) + generated - 1
    assert llm.num_pipelined_steps > 0
    llm.block_manager.check_all_free()


def test_preemption_and_chunked_prefill_match(tiny_models):
    prompts = random_prompts(12, 20, 200, vocab=512, seed=4)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    one_at_a_time, pipelined = engines(tiny_models["qwen2"], num_kv_blocks=36, max_num_seqs=8,
                                       max_num_batched_tokens=48)
    assert outputs(pipelined, prompts, params) == outputs(one_at_a_time, prompts, params)
    assert pipelined.stats()["num_preemptions"] > 0
    pipelined.block_manager.check_all_free()


def test_a_prompt_is_cached_by_the_step_that_ends_its_request(tiny_models):
    """A request that ends in the step that computed its prompt (max_tokens 1, as in scoring) leaves
    the prompt's full blocks in the prefix cache before its blocks are freed, pipelined or not."""
    prompts = random_prompts(4, 40, 70, vocab=512, seed=8)
    once = SamplingParams(max_tokens=1, temperature=0.0)
    for llm in engines(tiny_models["llama"], num_kv_blocks=128):
        llm.generate(prompts, once)
        before = llm.stats()["prefix_cache_hit_tokens"]
        llm.generate(prompts, once)
        size = llm.config.block_size
        assert llm.stats()["prefix_cache_hit_tokens"] - before == sum((len(p) - 1) // size * size for p in prompts)
        llm.block_manager.check_all_free()


def test_abort_while_a_token_is_in_flight(tiny_models):
    prompts = random_prompts(4, 10, 30, vocab=512, seed=2)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = outputs(LLM(tiny_models["llama"], num_kv_blocks=64, async_scheduling=False), prompts, params)
    llm = LLM(tiny_models["llama"], num_kv_blocks=64, async_scheduling=True)
    for i, prompt in enumerate(prompts):
        llm.add_request(f"r{i}", prompt, params)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    ends = {}
    for _ in range(4):
        for d in llm.step():
            tokens[d.request_id] += d.new_token_ids
    assert any(seq.request_id == "r1" for seq in llm._in_flight.sampling), "r1's next token was meant to be in flight"
    llm.abort("r1")
    while llm.has_unfinished():
        for d in llm.step():
            tokens[d.request_id] += d.new_token_ids
            if d.finished:
                ends[d.request_id] = d.finish_reason
    assert ends == {"r0": "length", "r1": "abort", "r2": "length", "r3": "length"}
    for i in (0, 2, 3):
        assert tokens[f"r{i}"] == expected[i][0]
    assert tokens["r1"] == expected[1][0][:len(tokens["r1"])] and len(tokens["r1"]) < 20
    llm.step()  # whatever was still in flight
    llm.block_manager.check_all_free()


@pytest.mark.slow
def test_grammars_and_bad_words_pipeline(default_model):
    """A grammar or a bad word masks a sequence's next token by its previous one: a step that samples
    such a sequence with a token in flight reads that step after launching its own forward and before
    sampling. The same outputs as one step at a time, every constraint kept, the engine pipelining all
    along; the bad word is a pair of tokens, so its ban needs the token read late."""
    one_at_a_time, pipelined = engines(default_model, num_kv_blocks=256)
    prompt = "In 1969, the first humans landed on"
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = one_at_a_time.generate([prompt], plain)[0].token_ids
    pair = next(free[j:j + 2] for j in range(len(free) - 1)
                if free[j:j + 2] in pipelined._bad_words_ids([pipelined.tokenizer.decode(free[j:j + 2])]))
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                             "population": {"type": "integer"}},
            "required": ["city", "population"], "additionalProperties": False}
    prompts = [prompt, "A JSON record of a city:", "Call me at", "Is the sky blue?", "The capital of France is"]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                             bad_words=[pipelined.tokenizer.decode(pair)]),
              SamplingParams(max_tokens=60, temperature=0.0, structured_outputs={"json": city}),
              SamplingParams(max_tokens=40, temperature=0.8, seed=2, structured_outputs={"regex": PHONE}),
              SamplingParams(max_tokens=20, temperature=0.7, seed=5, n=2, structured_outputs={"choice": ["yes", "no"]}),
              plain]

    def completions(llm):
        return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params)]

    expected = completions(one_at_a_time)
    assert completions(pipelined) == expected
    assert pipelined.num_pipelined_steps == pipelined.num_steps - 1  # all but the first
    banned = expected[0][0][0]
    assert banned != free and not any(banned[j:j + 2] == pair for j in range(len(banned) - 1))
    assert set(json.loads(expected[1][0][1])) == {"city", "population"}
    assert re.fullmatch(PHONE, expected[2][0][1])
    assert all(text in ("yes", "no") and reason == "stop" for _, text, reason in expected[3])
    pipelined.block_manager.check_all_free()


def test_penalties_pipeline_and_count_the_token_in_flight(tiny_models):
    """Penalties read a sequence's latest token where it still is, on the device (the step in flight):
    the same outputs as steps one at a time, greedy and seeded, with the engine pipelining throughout;
    and the penalties matter here (without them the outputs differ). A tiny random model seldom repeats
    itself, so the penalties here reward what was seen: the latest token decides the next."""
    prompts = random_prompts(6, 5, 40, vocab=512, seed=5)
    penalties = [dict(repetition_penalty=0.5), dict(presence_penalty=-2.0), dict(frequency_penalty=-1.5),
                 dict(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=-0.5),
                 dict(repetition_penalty=0.6, temperature=0.8, seed=11), dict(frequency_penalty=-2.0, temperature=1.0,
                                                                               top_p=0.9, seed=12)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **{"temperature": 0.0, **p}) for p in penalties]
    one_at_a_time, pipelined = engines(tiny_models["llama"], num_kv_blocks=128)
    expected = outputs(one_at_a_time, prompts, params)
    assert outputs(pipelined, prompts, params) == expected
    assert pipelined.num_pipelined_steps >= 20, pipelined.num_pipelined_steps
    plain = [SamplingParams(max_tokens=24, ignore_eos=True, **{"temperature": 0.0, **p})
             for p in ({}, {}, {}, {}, dict(temperature=0.8, seed=11), dict(temperature=1.0, top_p=0.9, seed=12))]
    unpenalized = outputs(one_at_a_time, prompts, plain)
    assert all(e[0] != u[0] for e, u in zip(expected, unpenalized)), "each penalty was meant to change its output"
    pipelined.block_manager.check_all_free()


@pytest.mark.slow
def test_min_tokens_pipeline(default_model):
    """min_tokens counts tokens still in flight: held-back EOS at the same step as one step at a time."""
    prompts = ["The capital of France is", "Say yes.", "2 + 2 ="]
    free = SamplingParams(max_tokens=40, temperature=0.0)
    held = SamplingParams(max_tokens=40, temperature=0.0, min_tokens=12)
    one_at_a_time, pipelined = engines(default_model, num_kv_blocks=128)
    ends_early = [len(ids) for ids, _, reason in outputs(one_at_a_time, prompts, free) if reason == "stop"]
    assert ends_early and min(ends_early) < 12, "some prompt was meant to end before min_tokens"
    expected = outputs(one_at_a_time, prompts, held)
    assert outputs(pipelined, prompts, held) == expected and pipelined.num_pipelined_steps > 0
    assert all(len(ids) >= 12 for ids, _, _ in expected)
    pipelined.block_manager.check_all_free()


def test_logprobs_pipeline(tiny_models):
    """Logprobs of sampled tokens are measured on the device as they are drawn and read with the tokens
    a step later: the same entries (values, ranks, top tokens) and cumulative logprobs as one step at a
    time, greedy and seeded, beside requests without them, an abort in flight included."""
    prompts = random_prompts(5, 5, 40, vocab=512, seed=6)
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, seed=4, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=5),
              SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True, logprobs=1)]
    one_at_a_time, pipelined = engines(tiny_models["llama"], num_kv_blocks=128)

    def with_logprobs(llm):
        return [(c.token_ids, c.logprobs, c.cumulative_logprob)
                for o in llm.generate(prompts, params) for c in o.outputs]

    expected = with_logprobs(one_at_a_time)
    assert with_logprobs(pipelined) == expected and pipelined.num_pipelined_steps >= 15
    assert [len(lp or []) for _, lp, _ in expected] == [20, 0, 20, 7, 20]
    assert all(len(entry) == 3 for entry in expected[0][1])  # greedy: its token is the likeliest of the 3
    pipelined.block_manager.check_all_free()
