"""Prompts given as embeddings (vLLM's prompt_embeds, TensorRT-LLM's p-tuning prompt_embedding_table):
greedy output equal to HF transformers' `generate(inputs_embeds=...)`, beside plain prompts, across
chunks, preemption and forks; the prefix cache reusing a table's blocks and telling tables apart; n-gram
drafts that never propose a virtual token; clear refusals; on a GPU beside CUDA graphs. Served through
tritonserver in test_server.py."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.config import SpeculativeConfig
from inflight.prompt_embeds import resolve
from inflight.speculative import NgramProposer

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ON_A_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


class HFEmbedsReference:
    """Greedy continuations from HF `generate(inputs_embeds=...)`, one request at a time."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.vocab = self.model.config.vocab_size

    def vectors(self, token_ids: list[int], table: torch.Tensor) -> torch.Tensor:
        """The prompt's input vectors: the model's embedding of real ids, the table's rows for virtual ones."""
        embedding = self.model.get_input_embeddings()
        with torch.inference_mode():
            return torch.stack([table[t - self.vocab] if t >= self.vocab else embedding.weight[t]
                                for t in token_ids])

    def __call__(self, vectors: torch.Tensor, max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = self.model.generate(inputs_embeds=vectors[None].float(),
                                      attention_mask=torch.ones(1, len(vectors), dtype=torch.long),
                                      max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
        return out[0].tolist()


@pytest.fixture(scope="module")
def default_reference(default_model):
    return HFEmbedsReference(default_model)


@pytest.fixture(scope="module")
def tiny_reference(tiny_models):
    return HFEmbedsReference(tiny_models["llama"])


def test_embeddings_equal_hf_generate_with_inputs_embeds(default_model, default_reference):
    """Real weights, one batch: a whole prompt of vectors (a soft prompt before a text's embeddings),
    the same as token ids with a table (virtual ids first, and in the middle), the text alone and the
    text's own embeddings: each output is HF's for the same vectors, and the text's embeddings give the
    text's own output while the soft prompt changes it."""
    ref = default_reference
    llm = LLM(default_model, num_kv_blocks=128)
    text_ids = llm.encode("The capital of France is")
    soft = torch.randn(6, ref.model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.3
    virtual = list(range(ref.vocab, ref.vocab + 6))
    middle = text_ids[:2] + virtual[3:] + text_ids[2:] + virtual[:2]
    text_vectors = ref.vectors(text_ids, soft)
    prompts = [{"prompt_embeds": torch.cat([soft, text_vectors])},
               {"prompt_token_ids": virtual + text_ids, "prompt_embedding_table": soft},
               {"prompt_token_ids": middle, "prompt_embedding_table": soft.numpy()},
               text_ids,
               {"prompt_embeds": text_vectors}]
    outputs = llm.generate(prompts, GREEDY)
    got = [o.outputs[0].token_ids for o in outputs]
    with_soft = ref(torch.cat([soft, text_vectors]), 16)
    assert got[0] == got[1] == with_soft
    assert got[2] == ref(ref.vectors(middle, soft), 16)
    assert got[3] == got[4] == ref(text_vectors, 16)
    assert with_soft != got[3], "the soft prompt changed nothing: a weak test"
    assert outputs[0].prompt_token_ids == virtual + [ref.vocab + 6 + i for i in range(len(text_ids))]
    assert outputs[1].prompt_token_ids == virtual + text_ids
    assert outputs[1].outputs[0].text == llm.tokenizer.decode(got[1])
    llm.block_manager.check_all_free()


def _soft_prompts(count: int, seed: int, rows: int | None = None) -> list[torch.Tensor]:
    """Tables of `rows` (else 20-40) random rows for the tiny model, the scale of its own embeddings."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows or rng.randint(20, 40), 64, generator=gen) * 0.2 for _ in range(count)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-at-a-time", "pipelined"])
def test_chunks_preemption_and_forks(tiny_models, tiny_reference, async_scheduling):
    """A tight pool (sequences preempted and recomputed from their vectors), a 16-token budget (prompts
    computed in chunks, virtual and real tokens in one), and n=2 forks: every output is HF's."""
    ref = tiny_reference
    tables = _soft_prompts(6, seed=1)
    rng = random.Random(2)
    prompts, expected = [], []
    for table in tables:
        virtual = [ref.vocab + i for i in range(len(table))]
        before, after = ([rng.randrange(3, ref.vocab) for _ in range(n)] for n in (5, 7))
        ids = before + virtual + after
        prompts.append({"prompt_token_ids": ids, "prompt_embedding_table": table})
        expected.append(ref(ref.vectors(ids, table), 40))
    llm = LLM(tiny_models["llama"], num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=16,
              async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
    outputs = llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e, e] for e in expected]
    assert llm.stats()["num_preemptions"] > 0
    llm.block_manager.check_all_free()


def test_beams_and_seeded_samples_over_a_prompts_own_embeddings(tiny_models, tiny_reference):
    """A prompt given as its own tokens' embeddings runs as the tokens do: a beam search (its new beams
    take the prompt's vectors along, for when they are preempted and recomputed) and seeded samples
    give the same completions."""
    ids = [7, 300, 41, 9, 256, 77, 18, 5, 499, 60, 33]
    vectors = tiny_reference.vectors(ids, None)
    params = [SamplingParams(beam_width=3, n=2, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, ignore_eos=True)]
    llm = LLM(tiny_models["llama"], num_kv_blocks=6, block_size=8)  # beams preempted and recomputed
    by_ids, by_vectors = (llm.generate(prompts, params) for prompts in ([ids, ids], [{"prompt_embeds": vectors}] * 2))
    completions = lambda outputs: [[(c.token_ids, c.text) for c in o.outputs] for o in outputs]  # noqa: E731
    assert completions(by_vectors) == completions(by_ids)
    assert llm.stats()["num_preemptions"] > 0
    llm.block_manager.check_all_free()


def test_the_prefix_cache_reuses_a_table_and_tells_tables_apart(tiny_models, tiny_reference):
    """The same vectors again find their blocks; the same virtual ids with other vectors find none of the
    blocks holding them, and their output is HF's for their own vectors (a cache that compared ids alone
    would hand them the first table's KV). A prompt whose cached blocks leave only its virtual last token
    computes that token from its vector."""
    ref = tiny_reference
    first, other = _soft_prompts(2, seed=3, rows=33)  # two full blocks of 16, and one token more
    llm = LLM(tiny_models["llama"], num_kv_blocks=32, block_size=16)
    ids = [ref.vocab + i for i in range(33)]
    runs = [(first, "first"), (first, "again"), (other, "other")]
    hits = []
    for table, _ in runs:
        before = llm.stats()["prefix_cache_hit_tokens"]
        out = llm.generate([{"prompt_token_ids": ids, "prompt_embedding_table": table}], GREEDY)[0]
        hits.append(llm.stats()["prefix_cache_hit_tokens"] - before)
        assert out.outputs[0].token_ids == ref(table, 16)
    assert hits == [0, 32, 0]
    # Shared real tokens before a table are reused all the same.
    prefix = list(range(5, 37))
    for table, expected_hits in ((first, 0), (other, 32)):
        before = llm.stats()["prefix_cache_hit_tokens"]
        out = llm.generate([{"prompt_token_ids": prefix + ids[:4], "prompt_embedding_table": table[:4]}], GREEDY)[0]
        assert llm.stats()["prefix_cache_hit_tokens"] - before == expected_hits
        assert out.outputs[0].token_ids == ref(ref.vectors(prefix + ids[:4], table), 16)
    llm.block_manager.check_all_free()


def test_ngram_drafts_never_propose_a_virtual_token(tiny_models, tiny_reference):
    """Where the lookup's match is followed by virtual ids, the drafts stop before them (a real token
    matched before them is proposed nothing); with drafts, the output is HF's."""
    ref = tiny_reference
    table = _soft_prompts(1, seed=4, rows=8)[0]
    segment = [11, 12, 13]
    ids = segment + [ref.vocab + i for i in range(8)] + [40, 41] + segment
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    _, embeds = resolve({"prompt_token_ids": ids, "prompt_embedding_table": table}, ref.vocab, 64, torch.float32, 256)
    for tokens, drafts in (([40, 41, 11], [12, 13]), ([9, 11, 12, 13], [])):
        seq = SimpleNamespace(params=SamplingParams(temperature=0), num_output_tokens=1, num_pending=0, matcher=None,
                              token_array=np.array(ids[:-3] + tokens), prompt_embeds=embeds)
        assert proposer.propose(seq, 4) == drafts
    llm = LLM(tiny_models["llama"], num_kv_blocks=32,
              speculative_config={"num_speculative_tokens": 4, "prompt_lookup_min": 1})
    out = llm.generate([{"prompt_token_ids": ids, "prompt_embedding_table": table}], GREEDY)[0]
    assert out.error is None and out.outputs[0].token_ids == ref(ref.vectors(ids, table), 16)
    llm.block_manager.check_all_free()


@pytest.mark.parametrize("prompt, params, message", [
    ({"prompt_embeds": torch.zeros(3, 63)}, None, r"rows of the model's hidden size \(64\)"),
    ({"prompt_embeds": torch.zeros(3)}, None, r"floats of shape \[rows, hidden size\]"),
    ({"prompt_embeds": torch.zeros(3, 64, dtype=torch.long)}, None, r"floats of shape"),
    ({"prompt_embeds": None}, None, r"floats of shape \[rows, hidden size\], got NoneType"),
    ({"prompt_token_ids": [512], "prompt_embedding_table": "rows"}, None, r"floats of shape .*, got str"),
    ({"prompt_embeds": torch.full((2, 64), float("nan"))}, None, "not finite"),
    ({"prompt_embeds": torch.zeros(3, 64), "prompt_token_ids": [1]}, None, "give it alone"),
    ({"prompt_token_ids": [1, 2]}, None, "needs 'prompt_embeds', or 'prompt_token_ids' with"),
    ({"prompt_token_ids": [1, 2], "prompt_embedding_table": torch.zeros(2, 64)}, None, "no prompt token id reads it"),
    ({"prompt_token_ids": [1, 514], "prompt_embedding_table": torch.zeros(2, 64)}, None, r"\[0, 514\)"),
    ({"prompt_token_ids": [512], "prompt_embedding_table": torch.zeros(2000, 64)}, None, "more than a prompt can hold"),
    ({"prompt_embeds": torch.zeros(3, 64), "images": []}, None, "a prompt dict takes"),
    ({"prompt_embeds": torch.zeros(3, 64)}, SamplingParams(prompt_logprobs=1), "prompt_logprobs cannot be measured"),
], ids=["hidden size", "one dimension", "integers", "none", "a string", "NaN", "both forms", "no table", "table unused",
        "beyond the table", "too many rows", "unknown key", "prompt logprobs"])
def test_bad_embeddings_are_refused_by_name(tiny_models, prompt, params, message):
    llm = LLM(tiny_models["llama"], num_kv_blocks=16, max_model_len=256)
    with pytest.raises(ValueError, match=message):
        llm.add_request("bad", prompt, params)
    assert not llm.has_unfinished()


@ON_A_GPU
def test_on_a_gpu_beside_cuda_graphs(tiny_models, tiny_reference):
    """On a GPU (float32, CUDA graphs for decode steps, async scheduling): the CPU's outputs, also for
    a prompt whose cached blocks leave only its virtual last token (a decode-shaped step no graph may
    take: the graph would read its id, not its vector)."""
    table = _soft_prompts(1, seed=5, rows=17)[0]
    ids = [tiny_reference.vocab + i for i in range(17)]
    prompt = {"prompt_token_ids": ids, "prompt_embedding_table": table}
    expected = tiny_reference(table, 16)
    llm = LLM(tiny_models["llama"], device="cuda", dtype="float32", num_kv_blocks=32, block_size=16)
    assert llm.config.async_scheduling and llm.runner.graphs is not None
    for _ in range(2):  # alone in its steps: the second time, a step of its last token only
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected
    assert llm.stats()["prefix_cache_hit_tokens"] == 16
    assert llm.generate([prompt, [5, 6, 7]], GREEDY)[0].outputs[0].token_ids == expected
    llm.block_manager.check_all_free()
