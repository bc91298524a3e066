"""Random mixes: requests of every kind arriving over the steps of one engine, some aborted, with
priorities, over a pool small enough to preempt and a budget small enough to chunk every prompt, on
prompts that share prefixes (the prefix cache) and repeat themselves (n-gram drafts), some given as
embeddings or with drafts of their own, some constrained to a regex, a choice or a JSON schema, some
taking each completion in one delta at its end (final-only) or no text at all (detokenize false).
Whatever ran beside a request, its output must be the one it gets alone, every refusal the same, every
block back. One step at a time and pipelined, with and without speculative decoding, and with LoRA
adapters; three seeds each; Llama, Mistral (blocks given back behind its sliding window) and Gemma 2 (its
windowed layer's blocks in tables of their own). With
faults injected at random steps: only the requests of those steps may fail. And over two ranks (tensor
parallelism), with and without faults. And with the prefix cache's host tier.

Mixes like these found that a prompt's end which drafted stranded the second of n completions (never
scheduled again, so its request never finished) and dropped the last row of context logits, while
each request alone was fine; test_speculative.py keeps that case, which these seeds do not reach."""

import dataclasses
import functools
import random
import time
from collections import defaultdict

import numpy as np
import pytest
import torch

from conftest import concurrently, graphs_on_a_cpu, running
from inflight import LLM, SamplingParams, faults
from lora_adapters import make_lora_adapters

VOCAB = 512
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
TIGHT = dict(num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=16, block_size=8, max_model_len=96)
CONSTRAINTS = [{"regex": "[a-z]{2,6}( [a-z]{2,6}){0,3}"}, {"choice": ["yes", "no", "maybe not"]},
               {"json": {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                         "required": ["n", "ok"], "additionalProperties": False}}]
CONFIGS = {
    "one-at-a-time": dict(async_scheduling=False),
    "pipelined": dict(async_scheduling=True),
    "drafts": dict(async_scheduling=False, speculative_config=NGRAM),
    "drafts-pipelined": dict(async_scheduling=True, speculative_config=NGRAM),
    "adapters": dict(async_scheduling=True, speculative_config=NGRAM, adapters=True),  # (lora_modules: a fixture's)
    # Every step a graph covers run through its padded layout and buffers (graphs_on_a_cpu: a GPU's CUDA
    # graphs, replayed as eager forwards); the requests alone run without.
    "graphs": dict(async_scheduling=True, speculative_config=NGRAM, adapters=True, graphs=True),
}


def random_params(rng: random.Random) -> SamplingParams:
    """One of the request kinds the engine serves, with its own max_tokens (1-24)."""
    greedy = dict(max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True)
    sampled = dict(greedy, temperature=0.9, top_p=0.9, seed=rng.randrange(1000))
    kinds = [
        greedy,
        dict(greedy, ignore_eos=False, stop_token_ids=rng.sample(range(3, VOCAB), 20)),
        dict(greedy, ignore_eos=False, stop=[rng.choice(["e", "a", "th", " "])],
             include_stop_str_in_output=rng.random() < 0.5),
        dict(greedy, min_tokens=min(5, greedy["max_tokens"]), ignore_eos=False),
        dict(greedy, logprobs=2),
        dict(greedy, max_tokens=rng.randint(1, 8), prompt_logprobs=1),
        dict(greedy, max_tokens=rng.randint(1, 8), return_context_logits=True),
        dict(greedy, n=3),
        dict(greedy, repetition_penalty=1.3, frequency_penalty=0.5),
        dict(greedy, no_repeat_ngram_size=2),
        dict(greedy, allowed_token_ids=rng.sample(range(3, VOCAB), 30)),
        dict(greedy, logit_bias={rng.randrange(3, VOCAB): 5.0 for _ in range(5)}),
        dict(greedy, truncate_prompt_tokens=10),
        dict(greedy, max_tokens=rng.randint(1, 16), beam_width=3, n=rng.choice([1, 3]),
             early_stopping=rng.choice([True, False, "never"]), length_penalty=rng.choice([0.5, 1.0, 2.0])),
        sampled,
        dict(sampled, n=2),
        dict(sampled, temperature=0.8, top_p=1.0, top_k=5, min_p=0.05, logprobs=1),
        dict(greedy, max_tokens=rng.randint(8, 24), ignore_eos=False, structured_outputs=rng.choice(CONSTRAINTS)),
        dict(sampled, ignore_eos=False, structured_outputs=rng.choice(CONSTRAINTS), logprobs=1),
        dict(greedy, max_tokens=rng.randint(1, 16), beam_width=2, ignore_eos=False,
             structured_outputs=rng.choice(CONSTRAINTS)),
    ]
    return SamplingParams(**rng.choice(kinds))


def random_prompt(rng: random.Random, tokens: list[int]) -> list[int] | dict:
    """The tokens, or as often vectors in their place (the tiny model's width, 64): all of them, or a
    table of virtual tokens ahead of them."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    form = rng.random()
    if form < 0.1:
        return {"prompt_embeds": torch.randn(len(tokens), 64, generator=gen) * 0.2}
    if form < 0.2:
        table = torch.randn(rng.randint(3, 10), 64, generator=gen) * 0.2
        return {"prompt_token_ids": [VOCAB + i for i in range(len(table))] + tokens, "prompt_embedding_table": table}
    return tokens


def random_requests(seed: int, adapters: list[str], count: int = 40) -> list[tuple]:
    """(id, prompt, params, priority, adapter or None): most prompts open with one of three prefixes,
    some repeat their own tokens, a few are longer than max_model_len; some requests bring drafts."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 40))] for _ in range(3)]
    requests = []
    for i in range(count):
        body = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 60))]
        if rng.random() < 0.3:
            body += body[:rng.randint(2, len(body))]
        prompt = random_prompt(rng, (rng.choice(prefixes) if rng.random() < 0.6 else []) + body)
        params = random_params(rng)
        if rng.random() < 0.1 and not params.return_context_logits and params.min_tokens == 0 \
                and params.n == 1 and params.drafts_judged_alone:  # (what drafts given with a request allow)
            params = dataclasses.replace(params, draft_token_ids=rng.sample(range(3, VOCAB), rng.randint(1, 4)))
        requests.append((f"r{i}", prompt, params, rng.randint(0, 2), rng.choice([None, *adapters])))
    return requests


class Outputs:
    """Per completion (request id, index): its tokens, finish reason, prompt logprobs' token ids and
    context logits; per request refused: why."""

    def __init__(self):
        self.tokens = defaultdict(list)
        self.ends, self.prompt_logprob_ids, self.context_logits, self.refused = {}, {}, {}, {}

    def add(self, llm: LLM, request_id: str, prompt: list[int] | dict, params: SamplingParams, priority: int,
            lora_name: str | None, final_only: bool = False) -> None:
        try:
            llm.add_request(request_id, prompt, params, priority=priority, lora_name=lora_name, final_only=final_only)
        except ValueError as e:
            self.refused[request_id] = str(e)

    def take(self, deltas) -> None:
        for d in deltas:
            key = (d.request_id, d.index)
            self.tokens[key] += d.new_token_ids
            if d.finish_reason is not None:
                self.ends[key] = d.finish_reason if d.error is None else (d.finish_reason, d.error)
            if d.prompt_logprobs is not None:
                self.prompt_logprob_ids[key] = [None if e is None else sorted(e) for e in d.prompt_logprobs]
            if d.context_logits is not None:
                self.context_logits[key] = d.context_logits

    def completions(self, request_id: str) -> list[tuple[str, int]]:
        return sorted(k for k in self.tokens.keys() | self.ends.keys() if k[0] == request_id)


def run_mix(llm: LLM, requests, seed: int) -> tuple[Outputs, set[str]]:
    """Requests arrive 0-3 a step in their order; now and then a running one is aborted."""
    rng = random.Random(seed + 1000)
    got, aborted, waiting = Outputs(), set(), list(requests)
    for _ in range(3000):
        if not (waiting or llm.has_unfinished()):
            break
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            if waiting:
                got.add(llm, *mixed_output_kind(*waiting.pop(0)))
        live = llm.unfinished_request_ids()
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            llm.abort(victim)
            aborted.add(victim)
        got.take(llm.step())
    else:
        raise AssertionError(f"unfinished after 3000 steps: {llm.unfinished_request_ids()}")
    got.take(llm.step())  # (pipelined: whatever an abort left in flight)
    return got, aborted


def final_only(request_id: str) -> bool:
    return int(request_id[1:]) % 3 == 0


def mixed_output_kind(request_id: str, prompt, params: SamplingParams, priority: int, lora_name: str | None):
    """The request as the mix sends it: every third one final-only (one delta a completion, its text at
    the end), every fourth one of the others without text (detokenize false, where no stop string reads
    it); alone, each is streamed with its text: the tokens and ends must not differ."""
    if int(request_id[1:]) % 4 == 1 and not params.stop and not final_only(request_id):
        params = dataclasses.replace(params, detokenize=False)
    return request_id, prompt, params, priority, lora_name, final_only(request_id)


def run_alone(model: str, settings: dict, requests) -> Outputs:
    """Each request on its own, one after another, on an engine of these settings with a roomy pool."""
    llm, alone = LLM(model, **{**TIGHT, "num_kv_blocks": 512}, **settings), Outputs()
    for request in requests:
        alone.add(llm, *request)
        while llm.has_unfinished():
            alone.take(llm.step())
    return alone


def record_batches(llm: LLM) -> dict[int, set[str]]:
    """{step number: the requests its batch ran}, steps counted as faults count them (those that run a
    batch)."""
    batches, schedule = {}, llm.scheduler.schedule

    def recording():
        batch = schedule()
        if batch.seqs:
            batches[llm.num_steps + 1] = {seq.request_id for seq in batch.seqs}
        return batch

    llm.scheduler.schedule = recording
    return batches


def count_blocks_given_back(llm: LLM) -> list[int]:
    """A counter (in a list) of the blocks `llm`'s sequences give back behind a sliding window."""
    given_back, release = [0], llm.block_manager.release_behind_window

    def counting(seq):
        released = lambda: seq.num_released_blocks + sum(group.num_released_blocks for group in seq.windows)  # noqa
        before = released()
        release(seq)
        given_back[0] += released() - before

    llm.block_manager.release_behind_window = counting
    return given_back


def run_mix_with_faults(llm: LLM, requests, seed: int) -> tuple[Outputs, set[str], set[str]]:
    """run_mix with the forward pass, the sampler or the detokenizer raising at six of its steps: a
    request in such a step (pipelined, also one in the step in flight before it) may end with that
    error, and the engine serves on. Also returns the requests that failed."""
    rng = random.Random(seed + 2000)
    fault_steps = sorted(rng.sample(range(2, 120, 3), 6))  # (spaced: three with no tokens between stop the engine)
    faults.inject(llm, ",".join(f"{rng.choice(list(faults.STAGES))}@{step}" for step in fault_steps))
    batches = record_batches(llm)
    got, aborted = run_mix(llm, requests, seed)
    assert llm.dead_reason is None and llm.stats()["failed_steps_total"] > 0
    errors = {key[0]: end[1] for key, end in got.ends.items() if isinstance(end, tuple)}
    assert errors and all("injected" in error for error in errors.values()), errors
    before = 1 if llm.config.async_scheduling else 0  # (the step in flight)
    # (and a final-only request aborted then: its text is decoded as it ends, mixed_output_kind)
    final_only_aborted = {request_id for request_id in aborted if final_only(request_id)}
    assert errors.keys() - final_only_aborted <= set().union(
        *(batches.get(step, set()) | batches.get(step - before, set()) for step in fault_steps))
    return got, aborted, set(errors)


def assert_as_alone(got: Outputs, alone: Outputs, requests, settings: dict, aborted: set[str],
                    failed: set[str] = frozenset()) -> None:
    """Each request's outputs are those it got alone; an aborted or failed one only as far as it got,
    ending as it did alone, or aborted, or (failed) with an error."""
    for request_id, _, params, _, _ in requests:
        assert got.refused.get(request_id) == alone.refused.get(request_id), request_id
        # A sampled request's draws follow the steps that carried its drafts (budget, batch size): with
        # drafts its tokens may differ from its own alone; where it can stop (EOS, a grammar's end), so
        # may their number and how they ended.
        sampled = params.temperature > 0 and ("speculative_config" in settings or bool(params.draft_token_ids))
        ends_anywhere = sampled and not params.ignore_eos

        def ends_as_alone(key, end) -> bool:
            return end in ("stop", "length") if ends_anywhere else end == alone.ends.get(key)

        completions = alone.completions(request_id)
        if request_id in aborted | failed:
            for key in got.completions(request_id):
                end = got.ends.get(key)
                assert end == "abort" or ends_as_alone(key, end) or (request_id in failed and end[0] == "error"), key
                if not (sampled or params.beam_search):  # (beams give their tokens at the end)
                    assert got.tokens[key] == alone.tokens[key][:len(got.tokens[key])], key
            continue
        assert got.completions(request_id) == completions, request_id
        for key in completions:
            assert ends_as_alone(key, got.ends.get(key)), (key, params)
            if ends_anywhere:
                assert len(got.tokens[key]) <= params.max_tokens, (key, params)
            elif sampled:
                assert len(got.tokens[key]) == len(alone.tokens[key]), (key, params)
            else:
                assert got.tokens[key] == alone.tokens[key], (key, params)
            assert got.prompt_logprob_ids.get(key) == alone.prompt_logprob_ids.get(key), key
            if key in alone.context_logits:
                np.testing.assert_allclose(got.context_logits[key], alone.context_logits[key], atol=1e-4, rtol=1e-4)


def check_a_mix(model: str, settings: dict, seed: int, tmp_path_factory, graphed: bool = False,
                num_kv_blocks: int = TIGHT["num_kv_blocks"], blocks_given_back: bool = False):
    """Run the random mix of `seed` on `model` with `settings` (with LoRA adapters of its own where they say
    `adapters`) in a tight pool, each request's outputs those it gets alone; returns the engine, its stats
    and its graphs (graphs_on_a_cpu's, where `graphed`)."""
    adapters = make_lora_adapters(model, tmp_path_factory.mktemp("lora")) if settings.pop("adapters", False) else {}
    settings["lora_modules"] = adapters or None
    requests = random_requests(seed, list(adapters))
    llm = LLM(model, **{**TIGHT, "num_kv_blocks": num_kv_blocks}, **settings)
    graphs = graphs_on_a_cpu(llm) if graphed else None
    given_back = count_blocks_given_back(llm)
    got, aborted = run_mix(llm, requests, seed)
    llm.block_manager.check_all_free()
    alone = run_alone(model, settings, requests)
    assert_as_alone(got, alone, requests, settings, aborted)
    assert (given_back[0] > 0) == blocks_given_back
    stats = llm.stats()
    assert aborted and stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    return llm, stats, graphs


# Each family runs two of the three mixes and each mix meets two families: every mix runs under every
# configuration, for two thirds of the CI time of all three on each.
MIXES = [("llama", 0), ("llama", 1), ("mistral", 1), ("mistral", 2), ("gemma2", 2), ("gemma2", 0)]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("family, seed", MIXES)
def test_every_request_of_a_random_mix_gets_its_output_alone(tiny_models, more_tiny_models, tmp_path_factory, family,
                                                             config, seed):
    """Llama, and Mistral, whose layers share a window of 48: its sequences give back the blocks behind it
    as they run (block_manager.release_behind_window); Gemma 2, whose windowed layer's blocks are in tables
    of their own (hybrid_blocks.py)."""
    model = tiny_models[family] if family in tiny_models else more_tiny_models(family)
    settings = dict(CONFIGS[config])
    graphed = settings.pop("graphs", False)
    llm, stats, graphs = check_a_mix(model, settings, seed, tmp_path_factory, graphed,
                                     # (Mistral's sequences hold fewer blocks: a smaller pool still preempts)
                                     num_kv_blocks=12 if family == "mistral" else TIGHT["num_kv_blocks"],
                                     blocks_given_back=family != "llama")
    if settings["async_scheduling"]:
        assert llm.num_pipelined_steps > 0
    if "speculative_config" in settings:
        assert stats["spec_decode_draft_tokens_total"] > 0
    if graphs is not None:
        assert graphs.replays > graphs.verify_replays + graphs.ragged_replays and graphs.verify_replays > 0 \
            and graphs.ragged_replays > 0, "decode steps, steps verifying drafts and steps with chunks: all replayed"


@pytest.mark.parametrize("family, seed, pipelined", [("llama", 0, False), ("llama", 1, True), ("gemma2", 2, True)])
def test_a_random_mix_with_a_draft_model_gets_each_request_its_output_alone(tiny_models, more_tiny_models,
                                                                          tmp_path_factory, family, seed, pipelined):
    """The mix with the model as its own draft model (draft_model.py), with LoRA adapters (which the draft
    model runs without), one step at a time and pipelined; Gemma 2's windowed layers in tables of their own,
    the draft model reading the full layers' tables."""
    model = tiny_models[family] if family in tiny_models else more_tiny_models(family)
    settings = dict(async_scheduling=pipelined, adapters=True,
                    speculative_config={"model": model, "num_speculative_tokens": 3})
    llm, stats, _ = check_a_mix(model, settings, seed, tmp_path_factory, blocks_given_back=family == "gemma2")
    assert stats["spec_decode_accepted_tokens_total"] > 0 and llm.draft_model is not None


@pytest.mark.parametrize("family, seed, config", [("llama", 0, "adapters"), ("gemma2", 2, "graphs")])
def test_a_random_mix_with_a_host_tier_gets_each_request_its_output_alone(tiny_models, more_tiny_models,
                                                                         tmp_path_factory, family, seed, config,
                                                                         monkeypatch):
    """The prefix cache's host tier (kv_offload_memory) under a mix: blocks the tight pool hands out kept in
    a host tier smaller than what it hands out, found there by later prompts (of an adapter, or by Gemma 2's
    windowed layers too) and copied back, three blocks at a time, into steps pipelined with drafts."""
    from inflight import kv_offload

    monkeypatch.setattr(kv_offload, "STAGED_BLOCKS", 3)
    model = tiny_models[family] if family in tiny_models else more_tiny_models(family)
    # (15 blocks of the tiny Llama; 31 of Gemma 2's heads of 256)
    settings = dict(CONFIGS[config], kv_offload_memory=(1 << 20) if family == "gemma2" else (1 << 16))
    graphed = settings.pop("graphs", False)
    _, stats, _ = check_a_mix(model, settings, seed, tmp_path_factory, graphed, blocks_given_back=family != "llama")
    assert stats["kv_offload_loaded_blocks_total"] > 0
    assert stats["kv_offload_stored_blocks_total"] > stats["kv_offload_blocks_total"]  # (the oldest forgotten)


@pytest.mark.parametrize("family, seed", [("llama", 19), ("mistral", 12)])
def test_mixes_reading_the_context_logits_of_one_graph_replayed_back_to_back(tiny_models, more_tiny_models,
                                                                             tmp_path_factory, family, seed):
    """Two mixes through the graphs (found among 50 more seeds) where a prompt's chunks replayed one graph
    step after step: a graph writes every replay's logits into the same output, and the chunks' context
    logits, read a step later (pipelined), were the next chunk's: raw_logits.to_host returned the rows
    themselves on a CPU (a copy from a GPU), harmless for eager steps' fresh outputs only."""
    test_every_request_of_a_random_mix_gets_its_output_alone(tiny_models, more_tiny_models, tmp_path_factory, family,
                                                             "graphs", seed)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("config", ["one-at-a-time", "drafts-pipelined"])
def test_faults_in_a_random_mix_end_only_the_requests_of_their_steps(tiny_models, config, seed):
    model, settings = tiny_models["llama"], CONFIGS[config]
    requests = random_requests(seed, [])
    llm = LLM(model, **TIGHT, **settings)
    got, aborted, failed = run_mix_with_faults(llm, requests, seed)
    llm.block_manager.check_all_free()
    alone = run_alone(model, settings, requests)
    assert_as_alone(got, alone, requests, settings, aborted, failed)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="transformers builds the tensor-parallel mesh on the GPU "
                                                      "where there is one; this test shards over CPU processes")
@pytest.mark.parametrize("with_faults", [False, True], ids=["healthy", "faults"])
def test_a_random_mix_over_two_ranks_gets_each_request_its_output_alone(tiny_models, with_faults):
    """Tensor parallelism (two ranks over gloo, one step at a time: pipelining needs one rank), with
    n-gram drafts; alone means on one rank."""
    model, settings = tiny_models["llama"], CONFIGS["drafts"]
    seed = int(with_faults)
    requests = random_requests(seed, [])
    llm = LLM(model, **TIGHT, **settings, tensor_parallel_size=2, num_threads=1)
    try:
        got, aborted, failed = run_mix_with_faults(llm, requests, seed) if with_faults \
            else (*run_mix(llm, requests, seed), set())
        llm.block_manager.check_all_free()
        assert llm.stats()["spec_decode_draft_tokens_total"] > 0
    finally:
        llm.close()
    alone = run_alone(model, settings, requests)
    assert_as_alone(got, alone, requests, settings, aborted, failed)


def served_inputs(prompt: list[int], params: SamplingParams, priority: int, lora_name: str | None) -> dict:
    """A request's Triton inputs: its token ids, the parameters that are not at their defaults as
    vLLM's sampling_parameters, and n as TensorRT-LLM's num_return_sequences (with input_ids, each
    completion streams in responses of its own)."""
    defaults, sampling = SamplingParams(), {}
    for field in dataclasses.fields(SamplingParams):
        value = getattr(params, field.name)
        if field.name != "n" and value != getattr(defaults, field.name):
            sampling[field.name] = {str(k): v for k, v in value.items()} if field.name == "logit_bias" else value
    sampling |= {"priority": priority} | ({"lora_name": lora_name} if lora_name else {})
    inputs = dict(input_ids=np.array(prompt, np.int32), sampling_parameters=sampling, return_finish_reason=True)
    return inputs | ({"num_return_sequences": params.n} if params.n > 1 else {})


def served_outputs(results: dict) -> Outputs:
    """Each stream's output_ids and finish reasons, per completion (sequence_index); its error, where it
    was refused (not cancelled)."""
    got = Outputs()
    for request_id, result in results.items():
        if result.error not in (None, "cancelled"):
            got.refused[request_id] = result.error
        for response in result.responses:
            key = (request_id, int(response["sequence_index"][0]) if "sequence_index" in response else 0)
            got.tokens[key] += [int(t) for t in response.get("output_ids", [])]
            reason = response.get("finish_reason")
            if reason is not None and reason[0]:
                got.ends[key] = reason[0].decode()
        if result.error == "cancelled":  # what had not ended, the cancellation aborted
            for key in got.completions(request_id):
                got.ends.setdefault(key, "abort")
    return got


@pytest.mark.server
def test_a_random_mix_through_tritonserver_gets_each_stream_its_output_alone(tiny_models, tmp_path):
    """The mix's requests sent as token ids (embeddings are left out: TensorRT-LLM's convention sends
    tables in float16) on gRPC streams of their own, all within three seconds, a fifth cancelled after
    a few responses, to a tritonserver serving pipelined with n-gram drafts and two LoRA adapters: each
    stream gets the output_ids and finish reasons its request gets alone offline, refusals alike,
    every block back."""
    from grpc_stream import generate
    from server_process import TritonServer

    model, settings = tiny_models["llama"], dict(CONFIGS["adapters"])
    del settings["adapters"]
    adapters = make_lora_adapters(model, tmp_path)
    requests = [r for r in random_requests(1, list(adapters)) if isinstance(r[1], list)]  # (two too long)
    rng, results = random.Random(1), {}

    def send(request_id, prompt, params, priority, lora_name, after_s, cancel_after):
        time.sleep(after_s)
        results[request_id] = generate(server.grpc_url, None, cancel_after=cancel_after,
                                       **served_inputs(prompt, params, priority, lora_name))

    with running(TritonServer(model=model, device="cpu", kv_cache_memory=None, num_threads=1,
                              lora_modules=adapters, **TIGHT, **settings)) as server:
        calls = [functools.partial(send, *request, rng.random() * 3, rng.choice([1, 2, 3]) if rng.random() < 0.2
                                   else None) for request in requests]
        with concurrently(calls, timeout=120):
            pass
        server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=20)
        assert server.alive()
    alone = run_alone(model, {**settings, "lora_modules": adapters}, requests)
    alone.prompt_logprob_ids.clear()  # (served in outputs of their own, not read here)
    alone.context_logits.clear()
    cancelled = {request_id for request_id, result in results.items() if result.error == "cancelled"}
    assert cancelled and alone.refused
    assert_as_alone(served_outputs(results), alone, requests, settings, cancelled)
