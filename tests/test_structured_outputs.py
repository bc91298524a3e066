"""Structured outputs on the default model: JSON schema, JSON object, regex, choice, grammar and
structural tags."""

import json
import re

import jsonschema
import pytest

from inflight import LLM, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "skills"],
    "additionalProperties": False,
}
NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Julia",
         "Kofi", "Lena", "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tomoko"]


@pytest.fixture(scope="module")
def llm(default_model):
    engine = LLM(default_model, num_kv_blocks=512, max_num_seqs=32, max_num_batched_tokens=512)
    yield engine
    engine.block_manager.check_all_free()


@pytest.fixture(scope="module")
def person_prompts(llm):
    return [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a JSON record for a person named {name} with the fields name, "
                                     "age, role (engineer, teacher, doctor or artist) and skills (a list)."}],
        tokenize=False, add_generation_prompt=True) for name in NAMES]


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95)],
                         ids=["greedy", "sampled"])
def test_json_schema_outputs_validate(llm, person_prompts, sampling):
    params = [SamplingParams(max_tokens=120, seed=i, structured_outputs={"json": PERSON}, **sampling)
              for i in range(len(person_prompts))]
    outs = llm.generate(person_prompts, params)
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs if o.finish_reason != "stop"]
    assert all(valid(o.text) for o in outs), [o.text for o in outs if not valid(o.text)]
    assert {json.loads(o.text)["name"] for o in outs} & set(NAMES)  # the prompts still steer the content


def test_without_the_constraint_the_same_prompts_mostly_fail(llm, person_prompts):
    outs = llm.generate(person_prompts, SamplingParams(max_tokens=120, temperature=0.0))
    assert sum(valid(o.text) for o in outs) <= 5


def test_regex_choice_grammar_and_json_object(llm, person_prompts):
    prompt = person_prompts[0]
    cases = [
        ({"regex": r"\+1-\d{3}-\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\+1-\d{3}-\d{3}-\d{4}", t)),
        ({"choice": ["yes", "no", "maybe \"so\""]}, lambda t: t in ("yes", "no", 'maybe "so"')),
        ({"grammar": 'root ::= "(" num ("+" num){1,3} ")"\nnum ::= [1-9] [0-9]?'},
         lambda t: re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?){1,3}\)", t)),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ]
    for spec, check in cases:
        for temperature in (0.0, 0.7):
            out = llm.generate([prompt], SamplingParams(max_tokens=200, temperature=temperature, seed=3,
                                                        structured_outputs=spec))[0]
            assert out.finish_reason == "stop" and check(out.text), (spec, out.text)


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm, person_prompts):
    plain = SamplingParams(max_tokens=40, temperature=0.0)
    alone = llm.generate(person_prompts[:4], plain)
    mixed = llm.generate(person_prompts[:8], [plain] * 4 + [SamplingParams(
        max_tokens=40, temperature=0.0, structured_outputs={"json": PERSON})] * 4)
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-at-a-time", "pipelined"])
def test_constraints_that_leave_no_token_end_that_request_alone(default_model, llm, async_scheduling):
    """A grammar with allowed_token_ids it cannot use, or allowed tokens that are all bad words, leave a
    row no token: that request ends with an error of its own (bad input), its blocks free; the request
    batched with it is served as alone, and the engine goes on."""
    engine = LLM(default_model, num_kv_blocks=128, async_scheduling=True) if async_scheduling else llm
    x, y = (engine.encode(c, add_special_tokens=False)[0] for c in "xy")
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    alone = engine.generate(["The capital of France is"], plain)[0]
    failed_before = engine.stats()["requests_failed_total"]
    for impossible in (SamplingParams(max_tokens=8, structured_outputs={"regex": "[0-9]+"}, allowed_token_ids=[x]),
                       SamplingParams(max_tokens=8, temperature=0.8, allowed_token_ids=[x, y], bad_words=["x", "y"])):
        failed, served = engine.generate(["Pick:", "The capital of France is"], [impossible, plain])
        assert failed.finish_reason == "error" and "no token can follow" in failed.error and failed.token_ids == []
        assert served.token_ids == alone.token_ids
    engine.block_manager.check_all_free()
    assert engine.stats()["requests_failed_total"] == failed_before + 2 and engine.dead_reason is None


def test_chunked_prefill_and_preemption_keep_the_constraint(default_model, llm, person_prompts):
    params = SamplingParams(max_tokens=120, temperature=0.0, structured_outputs={"json": PERSON})
    roomy = llm.generate(person_prompts[:8], params)
    tight = LLM(default_model, num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=40)
    outs = tight.generate(person_prompts[:8], params)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.text for o in outs] == [o.text for o in roomy] and all(valid(o.text) for o in outs)
    tight.block_manager.check_all_free()


def test_a_schema_is_compiled_once(llm, person_prompts):
    schema = dict(PERSON, title="compiled once")
    before = llm.grammars().num_compiled
    llm.generate(person_prompts[:2] * 10, SamplingParams(max_tokens=2, structured_outputs={"json": schema}))
    llm.generate(person_prompts[:2], SamplingParams(max_tokens=2, structured_outputs={"json": json.dumps(schema)}))
    assert llm.grammars().num_compiled == before + 1


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}
TOOL_CALL = re.compile(r"<function=get_weather>(.*?)</function>", re.S)


def test_structural_tags_constrain_what_follows_a_trigger(llm):
    """A structural tag (function calling): with at_least_one, the answer is a tool call whose arguments
    follow the schema, greedy and sampled; the older form (structures and triggers) means the same
    triggered tags: both accept a call with valid arguments and refuse one without."""
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What's the weather in Paris? Call the get_weather tool."}],
        tokenize=False, add_generation_prompt=True)
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<function="], "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "<function=get_weather>", "end": "</function>",
                  "content": {"type": "json_schema", "json_schema": CITY}}]}}
    for temperature in (0.0, 0.8):
        out = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=temperature, seed=5,
                                                    structured_outputs={"structural_tag": json.dumps(tag)}))[0]
        call = TOOL_CALL.fullmatch(out.text)
        assert out.finish_reason == "stop" and call, out.text
        jsonschema.validate(json.loads(call.group(1)), CITY)
    older = {"structures": [{"begin": "<function=get_weather>", "schema": json.dumps(CITY), "end": "</function>"}],
             "triggers": ["<function="]}  # (a schema as an object or, as here, its JSON text)
    newer = dict(tag, format=dict(tag["format"], at_least_one=False, stop_after_first=False))
    for spec in (older, newer):
        good, bad = (llm.grammars().matcher({"structural_tag": spec}) for _ in range(2))
        assert good.accept_string('The call: <function=get_weather>{"city": "Paris"}</function> done')
        assert not bad.accept_string('<function=get_weather>{"town": "Paris"}')


def test_max_tokens_cuts_a_constrained_output_as_length(llm, person_prompts):
    out = llm.generate(person_prompts[:1], SamplingParams(max_tokens=5, temperature=0.0,
                                                          structured_outputs={"json": PERSON}))[0]
    assert out.finish_reason == "length" and not valid(out.text)


@pytest.mark.parametrize("spec, words", [
    ({"json": {"type": "bogus"}}, "bogus"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a(b"}, "parenthesis"),
    ({"grammar": "root ::= "}, "EBNF"),
    ({"choice": []}, "choice"),
    ({"structural_tag": {"structures": [{"begin": "<f>"}], "triggers": ["<f"]}}, "begin, schema, end"),
    ({"structural_tag": "{oops"}, "structural_tag is not valid JSON"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "nonsense"}}}, "structural_tag could not be"),
    ({"jsonschema": {}}, "jsonschema"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "disable_any_whitespace must be true or false"),
])
def test_a_bad_constraint_is_refused_when_added(llm, spec, words):
    with pytest.raises(ValueError, match=words):
        llm.add_request("bad", "Hello", SamplingParams(structured_outputs=spec))
    assert not llm.has_unfinished()


def test_vllms_whitespace_and_strictness_options(llm):
    """vLLM's disable_any_whitespace, disable_additional_properties and disable_fallback may be true: a
    JSON object then takes no free whitespace (one line, xgrammar's ", " and ": "); JSON schemas are so
    and closed (xgrammar's strict mode) either way, so those options change nothing there."""
    grammars = llm.grammars()

    def takes(spec, text):
        return grammars.matcher(spec).accept_string(text)

    one_line, tight, loose = '{"a": [1, 2]}', '{"a":[1,2]}', '{\n  "a" : [1,  2]}'
    assert all(takes({"json_object": True}, text) for text in (one_line, tight, loose))
    spec = {"json_object": True, "disable_any_whitespace": True, "disable_fallback": True}
    assert takes(spec, one_line) and not takes(spec, tight) and not takes(spec, loose)  # (xgrammar's one form)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for options in ({}, {"disable_any_whitespace": True, "disable_additional_properties": True}):
        spec = {"json": schema, **options}
        assert takes(spec, '{"a": 1}') and not takes(spec, '{"a":1}')
        assert not takes(spec, '{"a": 1, "b": 2}')
