"""Faults inside the engine: every request gets exactly one final delta, failures end only what they
must, blocks come back, and the engine serves on (or stops cleanly when the fault persists)."""

import threading

import pytest
import torch

from conftest import random_prompts
from inflight import LLM, SamplingParams, faults
from inflight.engine import EngineDeadError
from inflight.sampler import filter_probs
from inflight.serving.engine_thread import EngineThread

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def expected(model):
    """Greedy outputs of the prompts below on a healthy engine."""
    prompts = random_prompts(16, 3, 60, vocab=512, seed=11)
    return prompts, [o.token_ids for o in LLM(model, num_kv_blocks=128).generate(prompts, GREEDY)]


def run(engine, requests: dict) -> dict[str, list]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    deltas = {request_id: [] for request_id in requests}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return deltas
        for d in engine.step():
            deltas[d.request_id].append(d)
    raise AssertionError("the engine did not finish")


def assert_one_final_each(deltas: dict[str, list]) -> None:
    for request_id, ds in deltas.items():
        assert [d.finished for d in ds].count(True) == 1 and ds[-1].finished, request_id


def test_a_failing_step_keeps_what_finished_earlier_in_it(model):
    """The reproduced bug: "a" finishes, then the detokenizer raises for "b" in the same step."""
    engine = LLM(model, num_kv_blocks=64)
    real = engine._detokenize

    def failing_for_b(seq, token_ids):
        if seq.request_id == "b":
            raise RuntimeError("detokenizer broke")
        return real(seq, token_ids)

    engine._detokenize = failing_for_b
    deltas = run(engine, {"a": ([5, 6, 7], SamplingParams(max_tokens=1, temperature=0.0)),
                          "b": ([8, 9, 10], GREEDY)})
    assert_one_final_each(deltas)
    assert (deltas["a"][-1].finish_reason, deltas["a"][-1].error) == ("length", None)
    assert deltas["b"][-1].finish_reason == "error" and "detokenizer broke" in deltas["b"][-1].error
    engine.block_manager.check_all_free()
    engine._detokenize = real
    assert run(engine, {"c": ([5, 6, 7], GREEDY)})["c"][-1].error is None


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-at-a-time", "async"])
@pytest.mark.parametrize("stage", list(faults.STAGES))
def test_injected_faults_end_each_request_once_and_the_engine_serves_on(model, expected, stage, async_scheduling):
    """Under async scheduling a failed step also fails the step in flight (its tokens are lost)."""
    prompts, outputs = expected
    engine = faults.inject(LLM(model, num_kv_blocks=128, max_num_batched_tokens=128,
                               async_scheduling=async_scheduling), f"{stage}@3,{stage}@9")
    deltas = run(engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    assert_one_final_each(deltas)
    failed = [i for i in range(len(prompts)) if deltas[str(i)][-1].error]
    assert failed and all(f"injected {stage} fault" in deltas[str(i)][-1].error for i in failed)
    for i in set(range(len(prompts))) - set(failed):  # the others are exact, faults or not
        assert [t for d in deltas[str(i)] for t in d.new_token_ids] == outputs[i]
    assert engine.stats()["failed_steps_total"] == 2 and engine.dead_reason is None
    engine.block_manager.check_all_free()
    again = run(engine, {f"again{i}": (p, GREEDY) for i, p in enumerate(prompts[:4])})
    assert [[t for d in again[f"again{i}"] for t in d.new_token_ids] for i in range(4)] == outputs[:4]


def test_a_failure_reading_the_step_in_flight_ends_its_requests_alone(model, expected):
    """Pipelined, a step that ranks beams is read before the next one is scheduled; a failure there
    ends the requests of that step, not the others (it once ended every request, waiting ones too)."""
    prompts, outputs = expected
    engine = LLM(model, num_kv_blocks=128, max_num_seqs=4, async_scheduling=True)
    real, failed_step = engine._complete, []

    def complete(step, deltas):
        if step is not None and step.beams and not failed_step:
            failed_step.append({seq.request_id for seq in step.batch.seqs})
            raise RuntimeError("reading the beams broke")
        return real(step, deltas)

    engine._complete = complete
    beams = SamplingParams(max_tokens=8, beam_width=2, temperature=0.0)
    deltas = run(engine, {"beams": (prompts[0], beams)} | {str(i): (p, GREEDY) for i, p in enumerate(prompts[1:], 1)})
    assert_one_final_each(deltas)
    failed = {request_id for request_id, ds in deltas.items() if ds[-1].error}
    assert "beams" in failed and failed == failed_step[0] and len(failed) < len(prompts) // 2
    for i in range(1, len(prompts)):
        if str(i) not in failed:
            assert [t for d in deltas[str(i)] for t in d.new_token_ids] == outputs[i]
    engine.block_manager.check_all_free()


def test_a_failure_outside_the_batch_fails_every_request(model):
    """When the scheduler itself raises, no request's state can be trusted: all end, blocks come back."""
    engine = LLM(model, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    real, calls = engine.scheduler.schedule, {"n": 0}

    def schedule():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("scheduler broke")
        return real()

    engine.scheduler.schedule = schedule
    deltas = run(engine, {str(i): ([5 + i, 6, 7], GREEDY) for i in range(4)})  # two of them wait
    assert_one_final_each(deltas)
    assert all("scheduler broke" in ds[-1].error for ds in deltas.values())
    engine.block_manager.check_all_free()
    assert run(engine, {"next": ([5, 6, 7], GREEDY)})["next"][-1].error is None


def test_failures_apart_never_stop_the_engine(model):
    """Steps that fail now and then, with steps that bring tokens between them, are not consecutive
    failures: more of them in all than max_consecutive_failed_steps leave the engine serving."""
    engine = faults.inject(LLM(model, num_kv_blocks=64, max_consecutive_failed_steps=2),
                           "forward@3,forward@6,forward@9,forward@12")
    errors = []
    for i in range(10):
        ds = run(engine, {str(i): ([5 + i, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))})
        errors.append(ds[str(i)][-1].error)
    assert engine.num_failed_steps == 4 and engine.dead_reason is None
    assert sum(e is not None for e in errors) == 4 and errors[-1] is None
    engine.block_manager.check_all_free()


def test_a_persistent_fault_stops_the_engine_and_the_thread_reports_it(model):
    engine = faults.inject(LLM(model, num_kv_blocks=64, max_consecutive_failed_steps=3), "forward@4+")
    finals, dead, done = {}, [], threading.Event()

    def on_delta(delta):
        if delta.finished:
            assert delta.request_id not in finals, "two final deltas"
            finals[delta.request_id] = delta

    def on_dead(reason):
        dead.append(reason)
        done.set()

    thread = EngineThread(lambda: engine, on_delta=on_delta, on_dead=on_dead)
    thread.start()
    ids = []
    for i in range(200):  # a failed step ends its batch: the engine stops once new work fails 3 times
        try:
            thread.submit(str(i), [5 + i % 100, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
        except EngineDeadError:
            break
        ids.append(str(i))
        if done.wait(0.05):
            break
    assert done.wait(60)
    thread.stop()
    assert sorted(finals, key=int) == ids and all(d.finish_reason == "error" for d in finals.values())
    assert len(dead) == 1 and "3 steps failed with no tokens" in dead[0] and "injected forward fault" in dead[0]
    with pytest.raises(EngineDeadError, match="stopped"):
        engine.add_request("late", [5, 6, 7], GREEDY)
    engine.block_manager.check_all_free()


@pytest.mark.parametrize("stage", ["sampler", "detokenize"])
def test_a_persistent_fault_after_the_forward_pass_stops_the_engine(model, stage):
    """Steps that only prefill chunks never reach the sampler or the detokenizer: succeeding between
    the failing steps, they must not count as the engine working (they once did, and it failed every
    request without ever stopping)."""
    engine = faults.inject(LLM(model, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=8), f"{stage}@1+")
    prompts = random_prompts(12, 20, 40, vocab=512, seed=3)  # each prefilled in chunks over several steps
    deltas = run(engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    assert_one_final_each(deltas)
    assert all(ds[-1].finish_reason == "error" for ds in deltas.values())
    assert engine.dead_reason is not None and f"injected {stage} fault" in engine.dead_reason
    assert engine.stats()["failed_steps_total"] == 3
    engine.block_manager.check_all_free()


def test_stop_strings_are_checked_in_the_text_flushed_at_the_end(model):
    """The last token is an incomplete character, held back until the request ends: the stop string
    that spans it is found in the flushed text."""
    engine = LLM(model, num_kv_blocks=64)
    tokenizer = engine.tokenizer
    ab, partial = tokenizer.encode("ab", add_special_tokens=False), tokenizer.convert_tokens_to_ids("Ã")
    script = iter([*ab, partial])
    engine._sample = lambda logits, seqs, in_flight, needs: (torch.tensor([next(script) for _ in seqs]), None)
    deltas = run(engine, {"x": ([5, 6, 7], SamplingParams(max_tokens=len(ab) + 1, stop=["b\ufffd"]))})
    final = deltas["x"][-1]
    assert "".join(d.new_text for d in deltas["x"]) == "a" and final.finish_reason == "stop"


def test_top_p_rows_do_not_depend_on_the_batch():
    """A row without top-p keeps every token, also beside a row with top-p (float32 cumsums of a
    large vocabulary round past 1.0 in the tail)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 49152) * 3

    class Seq:
        def __init__(self, **params):
            self.params = SamplingParams(temperature=1.0, **params)

    alone = filter_probs(logits[1:].clone(), [Seq()])[0]
    batched = filter_probs(logits.clone(), [Seq(top_p=0.5), Seq()])[1]
    assert torch.equal(alone, batched) and bool((batched > 0).all())
