"""Beam search against HF transformers' `generate(num_beams=...)`: the same hypotheses, token for token,
over beam widths, returned counts, length penalties, early stopping rules, end tokens and min_tokens;
batched with other requests, under preemption, async scheduling and the prefix cache; aborts and
errors leave no block behind."""

import itertools
import math
from collections import Counter

import pytest
import torch

from conftest import random_prompts
from inflight import LLM, SamplingParams
from inflight.detokenizer import find_stop_string

PIPELINED = pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-at-a-time", "pipelined"])
VOCAB = 512
EOS = 2


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, 5, 40, VOCAB, seed=11)


@pytest.fixture(scope="module")
def end_tokens(model, prompts):
    """Two tokens the model often generates, as stop_token_ids: beams then end, not only run out."""
    greedy = LLM(model, num_kv_blocks=64).generate(prompts, SamplingParams(temperature=0, max_tokens=30))
    return [t for t, _ in Counter(t for out in greedy for t in out.token_ids).most_common(2)]


def hf_beam_search(hf_tiny_llama, prompt: list[int], params: SamplingParams, ends: list[int]) -> tuple[list, list, int]:
    """HF's hypotheses (cut after their end token), their scores, and the steps its search took (its
    forward passes)."""
    ids = torch.tensor([prompt])
    forwards = []
    hook = hf_tiny_llama.register_forward_hook(lambda *_: forwards.append(1))
    with torch.inference_mode():
        out = hf_tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                num_beams=params.beam_width, num_return_sequences=params.n,
                                max_new_tokens=params.max_tokens, min_new_tokens=params.min_tokens,
                                length_penalty=params.length_penalty, early_stopping=params.early_stopping,
                                eos_token_id=ends, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    hook.remove()
    hypotheses = []
    for row in out.sequences[:, len(prompt):].tolist():
        end = next((i for i, t in enumerate(row) if t in ends), len(row) - 1)
        hypotheses.append(row[:end + 1])
    return hypotheses, out.sequences_scores.tolist(), len(forwards)


def capped(llm: LLM, max_steps: int) -> LLM:
    """`llm`, whose generate fails after max_steps steps (a search that can make no progress would
    otherwise step for ever)."""
    step, count = llm.step, itertools.count()

    def counted():
        assert next(count) < max_steps, f"no end after {max_steps} steps"
        return step()

    llm.step = counted
    return llm


CASES = [  # beam_width, n, max_tokens, length_penalty, early_stopping, min_tokens; whether a returned beam ends
    (2, 1, 12, 1.0, False, 0, False),
    (4, 4, 14, 1.0, False, 0, True),
    (3, 2, 16, 0.5, True, 0, True),
    (3, 3, 16, 2.0, "never", 0, False),
    (2, 2, 40, 0.0, False, 0, True),
    (3, 2, 40, 0.3, "never", 0, True),
    (3, 2, 30, 0.0, False, 8, True),
    (4, 2, 16, -0.5, True, 0, True),
    (3, 1, 12, 1.0, False, 5, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:6])))
def test_beam_search_equals_hf_generate(model, hf_tiny_llama, prompts, end_tokens, case):
    """Every prompt's n best hypotheses, in HF's order, with their scores (cumulative logprob /
    length ** length_penalty is HF's sequences_scores) and finish reasons: in one batch, with end
    tokens that end beams. Alone, each search stops at HF's step (its early-stopping rules)."""
    width, n, max_tokens, length_penalty, early_stopping, min_tokens, some_end = case
    params = SamplingParams(beam_width=width, n=n, max_tokens=max_tokens, length_penalty=length_penalty,
                            early_stopping=early_stopping, min_tokens=min_tokens, stop_token_ids=end_tokens)
    llm = LLM(model, num_kv_blocks=128)
    outs = llm.generate(prompts, params)
    ends = [EOS, *end_tokens]
    reasons = Counter()
    for prompt, out in zip(prompts, outs):
        expected, scores, steps = hf_beam_search(hf_tiny_llama, prompt, params, ends)
        assert [c.token_ids for c in out.outputs] == expected
        before = llm.num_steps
        alone = llm.generate([prompt], params)[0]
        assert [c.token_ids for c in alone.outputs] == expected and llm.num_steps - before == steps
        for completion, score in zip(out.outputs, scores):
            assert completion.cumulative_logprob / len(completion.token_ids) ** length_penalty == pytest.approx(
                score, abs=1e-4)
            assert completion.finish_reason == ("stop" if completion.token_ids[-1] in ends else "length")
            assert len(completion.token_ids) >= min_tokens
            assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        reasons.update(c.finish_reason for c in out.outputs)
    assert reasons["length"] > 0 and (reasons["stop"] > 0) == some_end  # (both ways of ending are tested)
    llm.block_manager.check_all_free()


@PIPELINED
def test_beams_beside_other_requests_under_preemption(model, hf_tiny_llama, prompts, end_tokens, async_scheduling,
                                                      hf_reference):
    """Beam searches batched with greedy requests, in a pool so small that beams are preempted and
    recomputed, and beams waiting for the others of their search make room for them: the same
    hypotheses as HF's, the greedy requests as HF's greedy; every block back."""
    beams = SamplingParams(beam_width=3, n=2, max_tokens=24, stop_token_ids=end_tokens)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # (9 blocks of 16 tokens: a search's three beams do not fit at once beside the others)
    llm = capped(LLM(model, num_kv_blocks=9, max_num_seqs=8, max_num_batched_tokens=48,
                     async_scheduling=async_scheduling), max_steps=1000)
    outs = llm.generate(prompts * 2, [beams] * len(prompts) + [greedy] * len(prompts))
    assert llm.stats()["num_preemptions"] > 0
    assert (llm.num_pipelined_steps > 0) == async_scheduling
    for prompt, out in zip(prompts, outs[:len(prompts)]):
        assert [c.token_ids for c in out.outputs] == hf_beam_search(hf_tiny_llama, prompt, beams, [EOS, *end_tokens])[0]
    for prompt, out in zip(prompts, outs[len(prompts):]):
        assert out.token_ids == hf_reference(model, prompt, 24)
    llm.block_manager.check_all_free()


def test_beams_share_the_prefix_cache_and_their_prompt(model, hf_tiny_llama, prompts, end_tokens):
    """A prompt's beams fork its blocks (computed once); a second search of the same prompt finds them in
    the prefix cache, and its hypotheses are the same."""
    params = SamplingParams(beam_width=4, n=4, max_tokens=10, stop_token_ids=end_tokens)
    prompt = prompts[0] * 3  # several full blocks
    llm = LLM(model, num_kv_blocks=64, enable_prefix_caching=True)
    first = llm.generate([prompt], params)[0]
    computed = llm.num_computed_tokens
    assert computed < len(prompt) + 4 * 10  # the prompt once, then a token per beam per step
    second = llm.generate([prompt], params)[0]
    assert llm.stats()["prefix_cache_hit_tokens"] >= len(prompt) // 16 * 16 - 16
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs] == hf_beam_search(
        hf_tiny_llama, prompt, params, [EOS, *end_tokens])[0]
    llm.block_manager.check_all_free()


PROCESSED = [  # SamplingParams beside beam_width 3, n 2; HF generate's arguments for the same
    (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
    (dict(logit_bias={17: 4.0, 300: 2.5, 41: -100.0}),
     dict(sequence_bias={(17,): 4.0, (300,): 2.5, (41,): -100.0})),
    (dict(allowed_token_ids=list(range(100, 400))), dict(prefix_allowed_tokens_fn=lambda *_: list(range(100, 400)))),
    (dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=2)),
    (dict(repetition_penalty=0.7, logit_bias={5: 3.0}, min_tokens=6, no_repeat_ngram_size=3),
     dict(repetition_penalty=0.7, sequence_bias={(5,): 3.0}, min_new_tokens=6, no_repeat_ngram_size=3)),
]


@pytest.mark.parametrize("values, hf_values", PROCESSED, ids=["repetition", "bias", "allowed", "ngrams", "all"])
def test_beams_under_penalties_bias_and_allowed_tokens_equal_hf(model, hf_tiny_llama, prompts, end_tokens, values,
                                                                 hf_values):
    """HF's beam search applies its logits processors to the log probabilities it ranks: the same
    hypotheses, token for token, and the same scores, with a repetition penalty, logit bias (HF's
    sequence_bias), allowed tokens and no repeated n-grams; each changes what plain beam search finds."""
    params = SamplingParams(beam_width=3, n=2, max_tokens=16, stop_token_ids=end_tokens, **values)
    plain = SamplingParams(beam_width=3, n=2, max_tokens=16, stop_token_ids=end_tokens)
    llm = LLM(model, num_kv_blocks=128)
    outs, plain_outs = llm.generate(prompts, params), llm.generate(prompts, plain)
    ends = [EOS, *end_tokens]
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            hf = hf_tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=3,
                                        num_return_sequences=2, max_new_tokens=16, eos_token_id=ends, pad_token_id=0,
                                        output_scores=True, return_dict_in_generate=True, **hf_values)
        expected = []
        for row in hf.sequences[:, len(prompt):].tolist():
            end = next((i for i, t in enumerate(row) if t in ends), len(row) - 1)
            expected.append(row[:end + 1])
        assert [c.token_ids for c in out.outputs] == expected
        for completion, score in zip(out.outputs, hf.sequences_scores.tolist()):
            assert completion.cumulative_logprob / len(completion.token_ids) == pytest.approx(score, abs=1e-4)
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain_outs]
    llm.block_manager.check_all_free()


def _contains(tokens: list[int], part: list[int]) -> bool:
    return any(tokens[i:i + len(part)] == part for i in range(len(tokens) - len(part) + 1))


def test_beams_never_complete_a_bad_word(model, hf_tiny_llama, prompts):
    """Words plain beam search produces, made bad words: no returned beam completes one (also beams that
    took another's seat), and the hypotheses are HF's with the same bad_words_ids."""
    llm = LLM(model, num_kv_blocks=128)
    plain = SamplingParams(beam_width=3, n=3, max_tokens=16, ignore_eos=True)
    found = [c.token_ids for o in llm.generate(prompts, plain) for c in o.outputs]
    words = []
    for token, _ in Counter(t for tokens in found for t in tokens).most_common():
        word = llm.tokenizer.decode([token])
        if word.strip() and any(_contains(tokens, ids) for tokens in found for ids in llm._bad_words_ids([word])):
            words.append(word)
        if len(words) == 4:
            break
    bad = llm._bad_words_ids(words)
    banned = SamplingParams(beam_width=3, n=3, max_tokens=16, ignore_eos=True, bad_words=words)
    for prompt, out in zip(prompts, llm.generate(prompts, banned)):
        assert not any(_contains(c.token_ids, ids) for c in out.outputs for ids in bad), words
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            hf = hf_tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=3,
                                        num_return_sequences=3, max_new_tokens=16, eos_token_id=None,
                                        pad_token_id=0, bad_words_ids=bad)
        assert [c.token_ids for c in out.outputs] == hf[:, len(prompt):].tolist()
    llm.block_manager.check_all_free()


@PIPELINED
def test_beams_under_a_grammar_equal_hf_with_the_grammars_allowed_tokens(model, hf_tiny_llama, prompts,
                                                                         async_scheduling):
    """Structured outputs under beam search: each beam's row masked to what its own grammar state allows
    (a beam that takes another's seat forks that beam's matcher), as HF's beam search with a
    prefix_allowed_tokens_fn giving the same grammar's tokens: the same hypotheses, each matching the
    regex; a small pool preempts and recomputes beams."""
    import re

    xgr = pytest.importorskip("xgrammar")  # (a GPU machine may not have it: gpu_session.sh carries it apart)
    pattern = "[a-z]{1,6}( [a-z]{1,6}){1,3}\\."
    spec = {"regex": pattern}
    params = SamplingParams(beam_width=3, n=2, max_tokens=24, structured_outputs=spec)
    llm = capped(LLM(model, num_kv_blocks=7, max_num_seqs=6, async_scheduling=async_scheduling), max_steps=1000)
    outs = llm.generate(prompts[:3], params)
    grammars = llm.grammars()

    def allowed(prompt):
        def tokens(batch_id, input_ids):
            matcher = grammars.matcher(spec)
            for t in input_ids[len(prompt):].tolist():
                assert matcher.accept_token(t)
            if matcher.is_terminated():  # (HF asks for beams that already ended too: any answer does)
                return list(range(VOCAB))
            bitmask = xgr.allocate_token_bitmask(1, VOCAB)
            matcher.fill_next_token_bitmask(bitmask, 0)
            row = torch.zeros(1, VOCAB)
            xgr.apply_token_bitmask_inplace(row, bitmask)
            return torch.nonzero(row[0] == 0)[:, 0].tolist()
        return tokens

    for prompt, out in zip(prompts[:3], outs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            hf = hf_tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=3,
                                        num_return_sequences=2, max_new_tokens=24, eos_token_id=EOS, pad_token_id=0,
                                        prefix_allowed_tokens_fn=allowed(prompt))
        expected = []
        for row in hf[:, len(prompt):].tolist():
            expected.append(row[:row.index(EOS) + 1] if EOS in row else row)
        assert [c.token_ids for c in out.outputs] == expected
        for c in out.outputs:
            assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c.text
    assert llm.stats()["num_preemptions"] > 0
    llm.block_manager.check_all_free()
    with pytest.raises(ValueError, match="ignore_eos is not supported with structured_outputs under beam search"):
        SamplingParams(beam_width=2, structured_outputs=spec, ignore_eos=True)


STOPS = [  # stop strings, include_stop_str_in_output, async scheduling, whether some step leaves a seat resting
    (["an"], False, False, False), (["ag", "ed"], True, True, False), ([" h", "nt", "\n "], False, True, False),
    ([" ", "."], False, True, True)]


@pytest.mark.parametrize("stop, include, async_scheduling, rests", STOPS,
                         ids=["one", "two-included-pipelined", "three-pipelined", "common-pipelined"])
def test_beams_end_at_stop_strings_as_hf_stop_strings(model, hf_tiny_llama, prompts, stop, include, async_scheduling,
                                                      rests):
    """Stop strings under beam search: a beam whose token completes one ends there, as with HF's
    stop_strings (its StopStringCriteria): the same hypotheses and scores; a stopped one's text is cut
    before the stop string (after it with include_stop_str_in_output), the others hold none. A small
    pool preempts and recomputes beams. Common stop strings end more of a step's ranked continuations
    than the ranking keeps beyond the beams: a seat left without one rests until a later step gives it
    one (without that, its search waits for its row for ever). (HF matches stop strings against special
    tokens' own text too, "ed" in "<issue_closed>"; here, as without beams, against the text the request
    gets: skipped special tokens have none. No special token decides a case here.)"""
    from transformers import AutoTokenizer, StoppingCriteriaList, StopStringCriteria

    params = SamplingParams(beam_width=3, n=3, max_tokens=20, stop=stop, include_stop_str_in_output=include)
    llm = capped(LLM(model, num_kv_blocks=9, max_num_seqs=6, async_scheduling=async_scheduling), max_steps=1000)
    rested, set_aside = [], llm.scheduler.set_aside
    llm.scheduler.set_aside = lambda seq: (rested.append(seq), set_aside(seq))
    outs = llm.generate(prompts, params)
    assert bool(rested) == rests
    # What generate's stop_strings build, built once: their cache misses on every call (its key holds the
    # vocabulary in get_vocab's order, which changes), at 1.3 s a build over the 49,152 tokens.
    stop_strings = StoppingCriteriaList([StopStringCriteria(AutoTokenizer.from_pretrained(model), stop)])
    reasons = Counter()
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            hf = hf_tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=3,
                                        num_return_sequences=3, max_new_tokens=20, eos_token_id=EOS, pad_token_id=0,
                                        stopping_criteria=stop_strings, output_scores=True,
                                        return_dict_in_generate=True)
        lengths = (hf.beam_indices >= 0).sum(dim=1).tolist()  # (-1 past a hypothesis's end)
        expected = [row[:n] for row, n in zip(hf.sequences[:, len(prompt):].tolist(), lengths)]
        assert [c.token_ids for c in out.outputs] == expected
        for c, score in zip(out.outputs, hf.sequences_scores.tolist()):
            assert c.cumulative_logprob / len(c.token_ids) == pytest.approx(score, abs=1e-4)
            text = llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            found = find_stop_string(text, stop, 0)
            assert (c.finish_reason == "stop") == (found is not None or c.token_ids[-1] == EOS)
            if found is not None:
                text = text[:found[1] if include else found[0]]
            assert c.text == text
        reasons.update(c.finish_reason for c in out.outputs)
    assert reasons["stop"] > 0 and (reasons["length"] > 0 or rests)  # (common ones end every hypothesis)
    assert llm.stats()["num_preemptions"] > 0
    llm.block_manager.check_all_free()


def test_beam_logprobs_are_the_models_own(model, hf_tiny_llama, prompts):
    """logprobs under beam search: each hypothesis token's log probability, rank and the k likeliest,
    as log_softmax of HF's logits along the hypothesis; the cumulative logprob is their sum; prompt
    logprobs come with the first completion."""
    params = SamplingParams(beam_width=3, n=2, max_tokens=8, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    out = LLM(model, num_kv_blocks=64).generate([prompts[1]], params)[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompts[1])
    for completion in out.outputs:
        tokens = prompts[1] + completion.token_ids
        with torch.inference_mode():
            reference = torch.log_softmax(hf_tiny_llama(torch.tensor([tokens])).logits[0].float(), dim=-1)
        total = 0.0
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = reference[len(prompts[1]) - 1 + i]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            assert set(row.topk(2).indices.tolist()) <= set(entry)
            total += entry[token].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)
        assert completion.finish_reason == "length"


@PIPELINED
def test_aborted_and_failed_searches_free_every_block(model, async_scheduling):
    """An abort mid-search ends the request with one final delta and no partial beam; so does a failed
    step; every beam's blocks come back, and the engine serves on."""
    llm = LLM(model, num_kv_blocks=32, async_scheduling=async_scheduling)
    llm.add_request("cancelled", list(range(3, 40)), SamplingParams(beam_width=4, max_tokens=200, ignore_eos=True))
    for _ in range(6):
        assert llm.step() == []
    assert len(llm.scheduler.running) == 4
    llm.abort("cancelled")
    deltas = [d for _ in range(2) for d in llm.step()]
    assert [(d.finish_reason, d.finished, d.new_token_ids) for d in deltas] == [("abort", True, [])]
    llm.block_manager.check_all_free()

    llm.add_request("failing", list(range(3, 40)), SamplingParams(beam_width=3, max_tokens=200, ignore_eos=True))
    for _ in range(4):
        llm.step()
    real_forward = llm._forward
    llm._forward = lambda *args: (_ for _ in ()).throw(RuntimeError("injected"))
    deltas = [d for _ in range(2) for d in llm.step()]
    llm._forward = real_forward
    assert [(d.finish_reason, d.finished) for d in deltas] == [("error", True)]
    llm.block_manager.check_all_free()
    again = llm.generate([list(range(3, 20))], SamplingParams(beam_width=2, max_tokens=4))[0]
    assert len(again.outputs) == 1 and len(again.token_ids) == 4


def test_beam_search_parameters_are_checked(model):
    for values, message in (
            ({"beam_width": 2, "n": 3}, "must not exceed beam_width"),
            ({"beam_width": 2, "temperature": 0.7}, "temperature must be 0 or 1"),
            ({"beam_width": 2, "top_p": 0.9}, "top_p is not supported with beam search"),
            ({"beam_width": 2, "min_p": 0.1}, "min_p is not supported with beam search"),
            ({"beam_width": 0}, "beam_width must be at least 1"),
            ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping must be"),
            ({"beam_width": 2, "length_penalty": math.inf}, "length_penalty must be a finite number"),
            ({"use_beam_search": True}, "use_beam_search needs best_of"),
            ({"use_beam_search": True, "best_of": 3, "beam_width": 2}, "disagree")):
        with pytest.raises(ValueError, match=message):
            SamplingParams.from_dict(values)
    # vLLM's older form, and values sent as strings
    params = SamplingParams.from_dict({"use_beam_search": "true", "best_of": "3", "n": "2",
                                       "early_stopping": "never", "length_penalty": "0.5"}, strings_allowed=True)
    assert (params.beam_width, params.n, params.early_stopping, params.length_penalty) == (3, 2, "never", 0.5)
    assert SamplingParams.from_dict({"early_stopping": "true"}, strings_allowed=True).early_stopping is True
    llm = LLM(model, num_kv_blocks=16, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"beam_width \(5\) exceeds max_num_seqs \(4\)"):
        llm.add_request("wide", [5, 6, 7], SamplingParams(beam_width=5))


def test_default_model_beam_search_equals_hf_generate(default_model):
    """The default model's real weights and EOS: a chat answer's beams as HF's."""
    from transformers import AutoModelForCausalLM

    llm = LLM(default_model, num_kv_blocks=64)
    messages = [{"role": "user", "content": "Name one primary color. Answer in one word."}]
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = llm.encode(prompt)
    params = SamplingParams(beam_width=3, n=3, max_tokens=24)
    out = llm.generate([prompt_ids], params)[0]
    hf_tiny_llama = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    expected, _, _ = hf_beam_search(hf_tiny_llama, prompt_ids, params, llm.eos_token_ids)
    assert [c.token_ids for c in out.outputs] == expected
    assert any(c.finish_reason == "stop" for c in out.outputs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_beam_search_on_a_gpu_with_cuda_graphs_and_async_scheduling(model, prompts, end_tokens):
    """On CUDA (graphs replayed for the beams' decode steps, each step's rows read after the copy event)
    the same hypotheses as on the CPU, beside greedy requests."""
    params = [SamplingParams(beam_width=3, n=2, max_tokens=20, stop_token_ids=end_tokens)] * len(prompts) + [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * len(prompts)
    expected = LLM(model, num_kv_blocks=64).generate(prompts * 2, params)
    llm = LLM(model, device="cuda", dtype="float32", num_kv_blocks=64, async_scheduling=True)
    outs = llm.generate(prompts * 2, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in expected]
    assert llm.runner.graphs.replays > 0
    llm.block_manager.check_all_free()


def test_a_search_stops_at_max_model_len(model, hf_tiny_llama, prompts):
    """max_model_len comes before max_tokens: the search ends there, as HF's with that many new tokens."""
    prompt = prompts[1][:30]
    out = LLM(model, num_kv_blocks=32, max_model_len=40).generate(
        [prompt], SamplingParams(beam_width=3, n=3, max_tokens=30))[0]
    expected = hf_beam_search(hf_tiny_llama, prompt, SamplingParams(beam_width=3, n=3, max_tokens=10), [EOS])[0]
    assert [c.token_ids for c in out.outputs] == expected
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out.outputs)
