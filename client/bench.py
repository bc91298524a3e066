"""Throughput benchmark: the same fixed-seed workload through HF static batching, HF continuous
batching and inflight (offline, and through tritonserver when asked), in one process on one model and
dtype, the prefix-caching workload and the cost of structured outputs and of LoRA adapters. Prints
markdown tables for the README.

    make bench                        # everything, 64 requests
    .venv/bin/python client/bench.py --num-requests 24 --peers inflight,hf-cb --repeats 1
"""

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))
DEFAULT_MODEL = str(ROOT / "models" / "SmolLM2-135M-Instruct")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(n: int, seed: int, prompt_range=(16, 512), output_range=(16, 256), vocab=49152) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(n)])


def load_hf(model_dir: str, dtype=torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def run_hf_static(model, work: Workload, batch_size: int) -> float:
    """HF `generate` on batches of `batch_size`, left padded; a batch runs to its longest request and
    only each request's own tokens are counted."""
    model.generation_config.eos_token_id = None
    pad = 0
    start = time.perf_counter()
    with tqdm(total=len(work.prompts), desc=f"hf static (batch {batch_size})", leave=False) as bar:
        for i in range(0, len(work.prompts), batch_size):
            prompts = work.prompts[i:i + batch_size]
            width = max(map(len, prompts))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
            with torch.inference_mode():
                model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                               max_new_tokens=max(work.output_lens[i:i + batch_size]),
                               min_new_tokens=max(work.output_lens[i:i + batch_size]))
            bar.update(len(prompts))
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_hf_continuous(model, work: Workload, max_batch_tokens: int, **options) -> float:
    """transformers' ContinuousBatchingManager with per-request max_new_tokens; `options` go to its
    ContinuousBatchingConfig (use_cuda_graph, use_async_batching, ...)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(work.output_lens), eos_token_id=-1, pad_token_id=0)
    blocks = sum(len(p) + n for p, n in zip(work.prompts, work.output_lens)) // 16 + len(work.prompts) + 64
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=blocks, max_batch_tokens=max_batch_tokens, **options)
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   block=True, timeout=5) as manager:
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(work.prompts, work.output_lens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        with tqdm(total=len(work.prompts), desc=f"hf continuous ({max_batch_tokens})", leave=False) as bar:
            done = 0
            while done < len(work.prompts):
                if manager.get_result(timeout=1) is not None:
                    done += 1
                    bar.update(1)
        return time.perf_counter() - start


def alternating(runs: dict, repeats: int) -> dict[object, list[float]]:
    """Each labelled run (a callable returning seconds) `repeats` times, in turn, so that a slow spell of
    a shared machine hits them all alike; the seconds of each, by label."""
    seconds = {label: [] for label in runs}
    for _ in range(repeats):
        for label, run in runs.items():
            seconds[label].append(run())
    return seconds


def timed(call, *args) -> float:
    start = time.perf_counter()
    call(*args)
    return time.perf_counter() - start


def make_llm(model_dir: str, **settings):
    from inflight import LLM

    settings.setdefault("num_kv_blocks", 4096)
    settings.setdefault("dtype", "float32")
    return LLM(model_dir, **settings)


def run_inflight(model_dir: str, work: Workload, logprobs: int | None = None, **settings) -> float:
    return inflight_run(model_dir, work, logprobs, **settings)[0]


def inflight_run(model_dir: str, work: Workload, logprobs: int | None = None, **settings):
    """(seconds, the engine, its outputs) of the workload offline, greedy, EOS ignored."""
    from inflight import SamplingParams

    llm = make_llm(model_dir, **settings)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs)
              for n in work.output_lens]
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outs) == work.output_tokens
    llm.block_manager.check_all_free()
    return elapsed, llm, outs


def dense_forward_rate(model_dir: str, tokens: int = 256, repeats: int = 5) -> tuple[float, str]:
    """Tokens per second of one dense forward pass over `tokens` tokens (HF transformers, torch SDPA
    attention, no cache): what the hardware gives the model at its most efficient; median of `repeats`.
    Measured as transformers runs it and with the linear layers packed for oneDNN as the engine runs
    them on a CPU (cpu_runtime.py); the faster of the two, and which it was."""
    from inflight.cpu_runtime import pack_linear_layers, packing_available

    model = load_hf(model_dir)
    ids = torch.randint(100, model.config.vocab_size, (1, tokens))

    def rate() -> float:
        times = []
        with torch.inference_mode():
            model(ids, use_cache=False, logits_to_keep=1)  # warm-up
            for _ in range(repeats):
                times.append(timed(lambda: model(ids, use_cache=False, logits_to_keep=1)))
        return tokens / statistics.median(times)

    rates = {"as transformers runs it": rate()}
    if packing_available():
        pack_linear_layers(model, tokens, tokens, merge_siblings=True)
        rates["with linear weights packed for oneDNN"] = rate()
    best = max(rates, key=rates.get)
    others = "; ".join(f"{name}: {r:.0f} tokens/s" for name, r in rates.items() if name != best)
    return rates[best], best + (f"; {others}" if others else "")


def stream_ttft(llm, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """Submit everything at once; return mean time to first token and output tokens/s."""
    from inflight import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        llm.add_request(f"ttft-{i}", p, params)
    first: dict[str, float] = {}
    tokens = 0
    while llm.has_unfinished():
        for d in llm.step():
            tokens += len(d.new_token_ids)
            if d.new_token_ids and d.request_id not in first:
                first[d.request_id] = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    return statistics.mean(first.values()), tokens / elapsed


def bench_prefix_caching(model_dir: str, n: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    system = [rng.randrange(100, 49152) for _ in range(400)]
    shared = [system + [rng.randrange(100, 49152) for _ in range(rng.randint(8, 24))] for _ in range(n)]
    distinct = [[rng.randrange(100, 49152) for _ in range(len(p))] for p in shared]
    rows = []
    for name, prompts in (("shared 400-token prefix", shared), ("no sharing", distinct)):
        for caching in (False, True):
            llm = make_llm(model_dir, enable_prefix_caching=caching)
            llm.generate([prompts[0][:8]], None)  # warm-up
            ttft, tps = stream_ttft(llm, prompts, 32)
            hit = llm.stats()["prefix_cache_hit_tokens"]
            rows.append((name, "on" if caching else "off", ttft, tps, hit))
            print(f"  {name}, caching {'on' if caching else 'off'}: mean TTFT {ttft:.2f} s, {tps:.1f} tok/s",
                  file=sys.stderr)
    return rows


def bench_kv_offload(model_dir: str, n: int, seed: int, sessions: int = 8, context: int = 400, pool_blocks: int = 64,
                     output_len: int = 32, **settings) -> list[tuple]:
    """`sessions` conversations of a `context`-token context each taking turns, one turn each a round (`n`
    turns in all, a new question of 8-24 tokens and `output_len` output tokens each): a pool of `pool_blocks`
    blocks of 16 tokens holds about two contexts, so by a session's next turn the pool has handed its blocks
    to the others. Prefix caching off, the pool alone, and the pool with a host tier holding every context.
    `settings`: the engines' others (make_llm's defaults: float32 on the CPU)."""
    rng = random.Random(seed)
    contexts = [[rng.randrange(100, 49152) for _ in range(context)] for _ in range(sessions)]
    turns = [contexts[i % sessions] + [rng.randrange(100, 49152) for _ in range(rng.randint(8, 24))]
             for i in range(n)]
    rows, block_bytes = [], None
    for name, tier in (("prefix caching off", dict(enable_prefix_caching=False)), ("the pool alone", {}),
                       ("the pool and a host tier", None)):
        if tier is None:  # (every context's blocks, and as many to spare)
            tier = dict(kv_offload_memory=2 * sessions * -(-context // 16) * block_bytes)
        llm = make_llm(model_dir, num_kv_blocks=pool_blocks, **tier, **settings)
        block_bytes = llm.runner.bytes_per_block
        llm.generate([turns[0][:8]], None)  # warm-up
        ttfts, seconds, tokens = [], 0.0, 0
        for first in range(0, n, sessions):
            ttft, tps = stream_ttft(llm, turns[first:first + sessions], output_len)
            round_tokens = output_len * len(turns[first:first + sessions])
            ttfts.append(ttft)
            seconds, tokens = seconds + round_tokens / tps, tokens + round_tokens
        stats = llm.stats()
        hit = stats["prefix_cache_hit_tokens"] / max(stats["prefix_cache_queried_tokens"], 1)
        loaded = stats.get("kv_offload_loaded_blocks_total", 0)
        rows.append((name, statistics.mean(ttfts), tokens / seconds, hit, loaded))
        print(f"  {name}: mean TTFT {rows[-1][1]:.3f} s, {rows[-1][2]:.1f} tok/s, hit {hit:.0%}", file=sys.stderr)
        del llm
    return rows


def kv_offload_table(rows: list[tuple], what: str) -> list[str]:
    """bench_kv_offload's rows as a markdown table, `what` naming the workload."""
    return [f"| {what} | mean TTFT (s) | output tok/s | prompt tokens found cached | blocks from the host tier |",
            "|---|---:|---:|---:|---:|",
            *(f"| {name} | {ttft:.3f} | {tps:.1f} | {hit:.0%} | {loaded} |" for name, ttft, tps, hit, loaded in rows)]


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                   "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
                   "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "role", "skills"], "additionalProperties": False,
}


def agreeing_tokens(ours: list[int], reference: list[int]) -> int:
    """How many leading tokens of `ours` equal the reference's (as many as both have, if none differs)."""
    return next((i for i, (x, y) in enumerate(zip(ours, reference)) if x != y), min(len(ours), len(reference)))


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> tuple[int, float]:
    """How many outputs equal the reference's, and the share of a reference's tokens they agree on from
    the start, on average."""
    pairs = list(zip(reference, outputs))
    return (sum(a == b for a, b in pairs),
            statistics.mean(agreeing_tokens(b, a) / len(a) for a, b in pairs))


KV_DTYPES = ("auto", "bfloat16", "fp8_e4m3")


def bench_kv_cache_dtype(model_dir: str, work: Workload, repeats: int, budget: int) -> dict:
    """The workload offline (greedy) with the model's float32 KV cache, a bfloat16 one and an fp8 one
    (`kv_cache_dtype`): output tok/s (medians of alternating runs), KV tokens a GiB holds, and how many
    outputs stay equal to the float32 cache's."""
    outputs, tokens_per_gib = {}, {}

    def run(kv_cache_dtype: str) -> float:
        elapsed, llm, outs = inflight_run(model_dir, work, kv_cache_dtype=kv_cache_dtype,
                                          max_num_batched_tokens=budget)
        outputs[kv_cache_dtype] = [o.token_ids for o in outs]
        tokens_per_gib[kv_cache_dtype] = llm.runner.block_size * 2**30 // llm.runner.bytes_per_block
        return elapsed

    seconds = alternating({kv: lambda kv=kv: run(kv) for kv in KV_DTYPES}, repeats)
    for kv, times in seconds.items():
        print(f"  kv_cache_dtype {kv}, each run: " + ", ".join(f"{work.output_tokens / t:.1f}" for t in times)
              + " tok/s", file=sys.stderr)
    same, leading = {}, {}
    for kv in KV_DTYPES[1:]:
        same[kv], leading[kv] = agreement(outputs["auto"], outputs[kv])
    return {"rates": {kv: work.output_tokens / statistics.median(times) for kv, times in seconds.items()},
            "tokens_per_gib": tokens_per_gib, "same": same, "leading": leading, "requests": len(outputs["auto"])}


QUANTIZED = {"fp8-dynamic": "compressed-tensors FP8-dynamic", "w4a16": "compressed-tensors W4A16 (groups of 64)"}


def bench_quantized(model_dir: str, work: Workload, repeats: int, budget: int) -> dict:
    """The workload offline (greedy) on the model and on its quantized copies (QUANTIZED, written by
    quantized_checkpoints.py): output tok/s (medians of alternating runs), and how many outputs stay equal
    to the unquantized model's."""
    import tempfile

    from quantized_checkpoints import quantized_copy

    outputs = {}

    def run(folder: str, fmt: str | None) -> float:
        elapsed, _, outs = inflight_run(folder, work, max_num_batched_tokens=budget)
        outputs[fmt] = [o.token_ids for o in outs]
        return elapsed

    with tempfile.TemporaryDirectory(prefix="inflight-quantized-") as root:
        folders = {None: model_dir, **{fmt: quantized_copy(model_dir, Path(root) / fmt, fmt, group=64)
                                       for fmt in QUANTIZED}}
        seconds = alternating({fmt: lambda fmt=fmt: run(folders[fmt], fmt) for fmt in folders}, repeats)
    for fmt, times in seconds.items():
        print(f"  {QUANTIZED.get(fmt, 'unquantized')}, each run: "
              + ", ".join(f"{work.output_tokens / t:.1f}" for t in times) + " tok/s", file=sys.stderr)
    same, leading = {}, {}
    for fmt in QUANTIZED:
        same[fmt], leading[fmt] = agreement(outputs[None], outputs[fmt])
    return {"rates": {fmt: work.output_tokens / statistics.median(times) for fmt, times in seconds.items()},
            "same": same, "leading": leading, "requests": len(outputs[None])}


def save_random_model(model_dir: str, out: str, config_class, keys: tuple[str, ...], **settings) -> None:
    """A model of `config_class` with random weights (seed 0, float32) saved to `out` with `model_dir`'s
    tokenizer: `model_dir`'s config values named in `keys`, its head size, and `settings`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    shape = AutoConfig.from_pretrained(model_dir).to_dict()
    config = config_class(**{k: shape[k] for k in keys if k in shape}, **settings,
                          head_dim=shape["hidden_size"] // shape["num_attention_heads"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)


def long_prompts_run(llm, prompts: list[list[int]], max_tokens: int = 64) -> tuple[float, list, int, int]:
    """Greedy outputs of `prompts` offline: (seconds, token ids, the most sequences running at once,
    preemptions); every block free after."""
    from inflight import SamplingParams

    peak, schedule = [0], llm.scheduler.schedule

    def counted():
        batch = schedule()
        peak[0] = max(peak[0], len(llm.scheduler.running))
        return batch

    llm.scheduler.schedule = counted
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    elapsed = time.perf_counter() - start
    llm.block_manager.check_all_free()
    return elapsed, [o.token_ids for o in outs], peak[0], llm.stats()["num_preemptions"]


def compare_long_prompts(runs: dict, work: "Workload", repeats: int) -> dict:
    """Each labelled way (a callable returning long_prompts_run's tuple) run `repeats` times, alternating:
    output tok/s (medians), the most sequences at once, preemptions, and whether every way's outputs are
    the same."""
    last = {}

    def timed(label):
        last[label] = runs[label]()
        return last[label][0]

    seconds = alternating({label: lambda label=label: timed(label) for label in runs}, repeats)
    outputs = [result[1] for result in last.values()]
    return {"rates": {label: work.output_tokens / statistics.median(t) for label, t in seconds.items()},
            "peaks": {label: result[2] for label, result in last.items()},
            "preemptions": {label: result[3] for label, result in last.items()},
            "same": all(out == outputs[0] for out in outputs)}


LONG_PROMPT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings")


def bench_sliding_window(model_dir: str, repeats: int, budget: int, seed: int, window: int = 512,
                         requests: int = 12) -> dict:
    """Long prompts (1,536-2,048 tokens, 64 out) on a model whose layers all share a sliding window: the
    default model's shape with random weights as model type mistral (Mistral 7B v0.1's kind), a window of
    512, in a pool of twice the longest sequence. Its blocks behind the window given back (the engine's
    way) against kept (the block manager told of no window, as before it gave any back): output tok/s
    (medians of alternating runs), the most sequences running at once, preemptions, equal outputs."""
    import tempfile

    from transformers import MistralConfig

    work = make_workload(requests, seed, prompt_range=(1536, 2048), output_range=(64, 64))
    blocks = 2 * -(-(max(map(len, work.prompts)) + 64) // 16)
    with tempfile.TemporaryDirectory() as out:
        save_random_model(model_dir, out, MistralConfig, LONG_PROMPT_KEYS, sliding_window=window,
                          max_position_embeddings=8192)

        def run(given_back: bool):
            llm = make_llm(out, num_kv_blocks=blocks, block_size=16, max_num_batched_tokens=budget)
            assert llm.block_manager.sliding_window == window
            if not given_back:
                llm.block_manager.sliding_window = None
            return long_prompts_run(llm, work.prompts)

        result = compare_long_prompts({given_back: lambda g=given_back: run(g) for given_back in (True, False)},
                                      work, repeats)
    return dict(result, blocks=blocks, requests=requests, window=window)


def bench_hybrid_tables(model_dir: str, repeats: int, budget: int, seed: int, window: int = 512,
                        requests: int = 12) -> dict:
    """Long prompts (1,536-2,048 tokens, 64 out) on a model whose layers are five windowed to one full: the
    default model's shape (30 layers) with random weights as model type gemma3_text, a window of 512, the
    KV cache's memory that of twice the longest sequence in every layer. The windowed layers' blocks in
    tables of their own (hybrid_kv_cache, the engine's way) against one table for every layer: output tok/s
    (medians of alternating runs), the most sequences running at once, preemptions, equal outputs."""
    import tempfile

    from transformers import AutoConfig, Gemma3TextConfig

    work = make_workload(requests, seed, prompt_range=(1536, 2048), output_range=(64, 64))
    shape = AutoConfig.from_pretrained(model_dir)
    head_dim = shape.hidden_size // shape.num_attention_heads
    every_layer = 16 * (2 * shape.num_hidden_layers * shape.num_key_value_heads * head_dim * 4 + 8)
    memory = 2 * -(-(max(map(len, work.prompts)) + 64) // 16) * every_layer
    with tempfile.TemporaryDirectory() as out:
        save_random_model(model_dir, out, Gemma3TextConfig, LONG_PROMPT_KEYS, sliding_window=window,
                          max_position_embeddings=8192, query_pre_attn_scalar=head_dim)

        def run(hybrid: bool):
            llm = make_llm(out, num_kv_blocks=None, kv_cache_memory=memory, block_size=16,
                           max_num_batched_tokens=budget, hybrid_kv_cache=hybrid)
            assert llm.runner.window_groups == (5 if hybrid else 0)
            return long_prompts_run(llm, work.prompts)

        result = compare_long_prompts({hybrid: lambda h=hybrid: run(h) for hybrid in (True, False)}, work, repeats)
    return dict(result, memory=memory, requests=requests, window=window)


def bench_mixture_of_experts(model_dir: str, work: Workload, repeats: int, dtype: str = "float32") -> dict:
    """A mixture-of-experts model on a CPU, its experts and routers through oneDNN's packed matmul
    (cpu_experts.py, the engine's way) against transformers' own experts (MKL; the dense layers packed in
    both): random weights as model type mixtral, the default model's hidden size, heads and vocabulary, 8
    layers of 8 experts (1,024 wide, 2 per token); a quarter of the workload; processing rate (prompt and
    output tokens per second, medians of alternating runs, each engine built once) and equal greedy
    outputs."""
    import tempfile

    from transformers import MixtralConfig

    import inflight.model_runner
    from inflight import SamplingParams

    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta",
            "tie_word_embeddings")
    k = max(3, len(work.prompts) // 4)
    prompts, params = work.prompts[:k], [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                         for m in work.output_lens[:k]]
    with tempfile.TemporaryDirectory() as out:
        save_random_model(model_dir, out, MixtralConfig, keys, num_hidden_layers=8, intermediate_size=1024,
                          num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048)
        packed = make_llm(out, dtype=dtype)
        pack_experts, inflight.model_runner.pack_experts = inflight.model_runner.pack_experts, lambda *a: 0
        try:
            unpacked = make_llm(out, dtype=dtype)
        finally:
            inflight.model_runner.pack_experts = pack_experts
        engines = {"experts packed (the engine's way)": packed, "transformers' experts": unpacked}
        outputs = {}

        def run(label: str) -> float:
            start = time.perf_counter()
            outputs[label] = [o.token_ids for o in engines[label].generate(prompts, params)]
            return time.perf_counter() - start

        for label in engines:  # a first run each to warm the process up, not counted
            run(label)
        seconds = alternating({label: lambda x=label: run(x) for label in engines}, repeats)
    tokens = sum(map(len, prompts)) + sum(work.output_lens[:k])
    first, second = outputs.values()
    return {"rates": {label: tokens / statistics.median(t) for label, t in seconds.items()}, "requests": k,
            "same": sum(a == b for a, b in zip(first, second))}


def bench_n_completions(model_dir: str, work: Workload, repeats: int) -> dict[str, float]:
    """A quarter of the workload's prompts with n=4 completions each, against the same prompts sent as
    four separate requests each (sampled, seeded, EOS ignored: the same tokens to make); output tok/s,
    medians of alternating runs."""
    from inflight import SamplingParams

    k = max(1, len(work.prompts) // 4)
    prompts, lengths = work.prompts[:k], work.output_lens[:k]
    forked = [SamplingParams(n=4, max_tokens=m, temperature=1.0, seed=i, ignore_eos=True)
              for i, m in enumerate(lengths)]
    separate = [SamplingParams(max_tokens=m, temperature=1.0, seed=i + j, ignore_eos=True)
                for i, m in enumerate(lengths) for j in range(4)]
    tokens = 4 * sum(lengths)
    seconds = alternating({
        "n=4": lambda: timed(make_llm(model_dir).generate, prompts, forked),
        "4 separate requests": lambda: timed(make_llm(model_dir).generate,
                                             [p for p in prompts for _ in range(4)], separate),
    }, repeats)
    result = {label: tokens / statistics.median(times) for label, times in seconds.items()}
    print(f"  n completions ({k} prompts x 4, {tokens} tokens): {result}", file=sys.stderr)
    return result


def bench_lora(model_dir: str, work: Workload, repeats: int) -> dict[str, float]:
    """A quarter of the workload without LoRA; with two adapters loaded (ranks 8 and 4 over 6 of a layer's
    7 projections between them), every request on the base model, then the requests spread over the
    base model and both adapters; and the same with the two adapters as TensorRT-LLM's LoRA tasks in two
    slots (each sent once before, then named by task id). Output tok/s, medians of alternating runs, each
    engine built once."""
    import tempfile

    from inflight import LoRATask, SamplingParams
    from lora_adapters import LORA_ADAPTERS, make_lora_adapters, trtllm_lora_tensors

    k = max(3, len(work.prompts) // 4)
    prompts, params = work.prompts[:k], [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                         for m in work.output_lens[:k]]
    spread = [(None, *LORA_ADAPTERS)[i % 3] for i in range(k)]
    with tempfile.TemporaryDirectory() as folder:
        adapters = make_lora_adapters(model_dir, Path(folder))
        plain, with_lora = make_llm(model_dir), make_llm(model_dir, lora_modules=adapters)
        with_tasks = make_llm(model_dir, lora_task_slots=2)
        task_ids = {name: task_id for task_id, name in enumerate(adapters, start=1)}
        with_tasks.generate(prompts[:2], params[:2], lora_task=[LoRATask(task_ids[name], *trtllm_lora_tensors(path))
                                                                for name, path in adapters.items()])
        by_id = [None if name is None else LoRATask(task_ids[name]) for name in spread]
        seconds = alternating({
            "no adapters": lambda: timed(plain.generate, prompts, params),
            "2 adapters loaded, base requests": lambda: timed(with_lora.generate, prompts, params),
            "2 adapters loaded, requests spread over base and both": lambda: timed(
                lambda: with_lora.generate(prompts, params, lora_name=spread)),
            "2 LoRA task slots, base requests": lambda: timed(with_tasks.generate, prompts, params),
            "2 LoRA task slots, requests spread over base and both tasks": lambda: timed(
                lambda: with_tasks.generate(prompts, params, lora_task=by_id)),
        }, repeats)
    tokens = sum(work.output_lens[:k])
    result = {label: tokens / statistics.median(times) for label, times in seconds.items()}
    print(f"  LoRA ({k} requests, {tokens} tokens): {result}", file=sys.stderr)
    return result


def bench_beam_search(model_dir: str, work: Workload, repeats: int, width: int = 4, max_tokens: int = 32) -> dict:
    """Beam searches (width 4, 32 tokens, EOS ignored) of an eighth of the workload's prompts: inflight
    (every search batched with the others) against HF `generate(num_beams=4)` one prompt at a time and
    on all the prompts in one left-padded batch; the searches per second (medians of alternating runs)
    and how many best beams are HF's (one prompt at a time)."""
    from inflight import SamplingParams

    prompts = work.prompts[:max(2, len(work.prompts) // 8)]
    params = SamplingParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    llm, hf = make_llm(model_dir), load_hf(model_dir)
    ours, theirs = [], []

    def run_inflight_searches() -> float:
        start = time.perf_counter()
        ours[:] = [out.token_ids for out in llm.generate(prompts, params)]
        return time.perf_counter() - start

    def run_hf_searches() -> float:
        start = time.perf_counter()
        theirs.clear()
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, do_sample=False,
                                  max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
            theirs.append(out[0, len(prompt):].tolist())
        return time.perf_counter() - start

    def run_hf_batch() -> float:
        longest = max(map(len, prompts))
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, num_beams=width, do_sample=False, max_new_tokens=max_tokens,
                        eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - start

    seconds = alternating({"inflight": run_inflight_searches, "hf": run_hf_searches, "hf-batch": run_hf_batch},
                          repeats)
    result = {label: len(prompts) / statistics.median(times) for label, times in seconds.items()}
    result.update(prompts=len(prompts), same=sum(a == b for a, b in zip(ours, theirs)))
    print(f"  beam search: {result}", file=sys.stderr)
    return result


# Requests whose answers repeat much of their prompts (edits, conversions, copies): where drafts looked up
# in a sequence's own tokens are kept.
EDITING_TASKS = [
    "Add type hints to this function and return the whole code:\n```python\ndef merge(a, b):\n    result = []\n"
    "    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            result.append(a[i])\n"
    "            i += 1\n        else:\n            result.append(b[j])\n            j += 1\n"
    "    return result + a[i:] + b[j:]\n```",
    "Fix the spelling in this paragraph and return it: Teh quick brown fox jumpd over the lazy dog. The dog was not "
    "amused, and it barked loudly at teh fox untill it ran away into the forrest.",
    "Convert this list to JSON objects with the keys name and age:\nAlice 31\nBob 27\nCarol 45\nDave 38\nEve 29",
    "Rename the variable x to count in this code and return it:\n```python\nx = 0\nfor item in items:\n"
    "    if item.valid:\n        x += 1\nprint(x)\n```",
    "Repeat the following sentence exactly, twice: The meeting has been moved to Thursday at 3 pm in room 204.",
    "Return this configuration with every key in uppercase: {\"host\": \"localhost\", \"port\": 8080, "
    "\"debug\": true, \"workers\": 4, \"timeout\": 30}",
]
# Requests whose answers quote little of their prompts: what drafts cost where few are kept.
OPEN_QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are the main differences between a list and a tuple in Python?",
    "Give three tips for sleeping better.",
    "Describe the water cycle.",
    "Why do cats purr?",
]


def bench_speculative(model_dir: str, tasks: list[str], repeats: int, max_tokens: int = 96, drafts: int = 4,
                      draft_model: str | None = None) -> dict:
    """Greedy answers to `tasks` (chat template, EOS ends them), one request at a time and all at once:
    HF generate plain and with its prompt lookup decoding (prompt_lookup_num_tokens), inflight without
    drafts and with n-gram drafts; with `draft_model` (a folder, and its name for the labels), HF's assisted
    generation (assistant_model) and inflight's draft model in their place. Output tokens per second (medians
    of alternating runs), the share of drafts kept, and how many outputs equal HF's plain greedy ones."""
    from transformers import AutoTokenizer

    from inflight import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": task}],
                                             add_generation_prompt=True)["input_ids"] for task in tasks]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    hf = load_hf(model_dir)
    plain = make_llm(model_dir, num_kv_blocks=512)
    spec = {"num_speculative_tokens": drafts, **({"model": draft_model[0]} if draft_model else {})}
    drafting = make_llm(model_dir, num_kv_blocks=512, speculative_config=spec)
    helper = dict(assistant_model=load_hf(draft_model[0])) if draft_model else dict(prompt_lookup_num_tokens=drafts)
    how = f"draft model {draft_model[1]}" if draft_model else "n-gram drafts"
    outputs: dict[str, list[list[int]]] = {}

    def hf_run(label: str, **options) -> float:
        start = time.perf_counter()
        outs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                  pad_token_id=tokenizer.eos_token_id, **options)
            outs.append(out[0, len(prompt):].tolist())
        outputs[label] = outs
        return time.perf_counter() - start

    def inflight_run(label: str, llm, one_at_a_time: bool) -> float:
        start = time.perf_counter()
        batches = [[p] for p in prompts] if one_at_a_time else [prompts]
        outputs[label] = [o.outputs[0].token_ids for batch in batches for o in llm.generate(batch, params)]
        return time.perf_counter() - start

    runs = {
        "hf": lambda: hf_run("hf"),
        "hf-helped": lambda: hf_run("hf-helped", **helper),
        "plain-1": lambda: inflight_run("plain-1", plain, True),
        "spec-1": lambda: inflight_run("spec-1", drafting, True),
        "plain": lambda: inflight_run("plain", plain, False),
        "spec": lambda: inflight_run("spec", drafting, False),
    }
    labels = {
        "hf": "HF generate, one at a time",
        "hf-helped": (f"HF generate with assistant_model={draft_model[1]}" if draft_model
                      else f"HF generate with prompt_lookup_num_tokens={drafts}") + ", one at a time",
        "plain-1": "inflight, one at a time",
        "spec-1": f"inflight, {how} ({drafts}), one at a time",
        "plain": "inflight, all at once",
        "spec": f"inflight, {how} ({drafts}), all at once",
    }
    seconds = alternating(runs, repeats)
    tokens = sum(map(len, outputs["hf"]))
    stats = drafting.stats()
    kept = stats["spec_decode_accepted_tokens_total"]
    result = {
        "rows": [(labels[key], tokens / statistics.median(times),
                  sum(a == b for a, b in zip(outputs[key], outputs["hf"]))) for key, times in seconds.items()],
        "kept": kept / max(stats["spec_decode_draft_tokens_total"], 1),
        "tokens_per_draft_step": 1 + kept / max(stats["spec_decode_drafts_total"], 1),
        "requests": len(prompts), "tokens": tokens,
    }
    print(f"  speculative decoding: {result}", file=sys.stderr)
    return result


def bench_structured_outputs(model_dir: str, n: int, repeats: int) -> dict:
    """n chat requests for a person record, all under one JSON schema, against the same requests
    unconstrained and cut to the same lengths (so both runs make the same tokens in the same batches),
    alternating, medians of `repeats`; and the time to build the tokenizer info and to compile the
    schema, cold and cached."""
    from inflight import SamplingParams

    llm = make_llm(model_dir)
    start = time.perf_counter()
    grammars = llm.grammars()
    info_s = time.perf_counter() - start
    timings = {}
    for label in ("cold", "cached"):
        start = time.perf_counter()
        grammars.matcher({"json": PERSON_SCHEMA})
        timings[label] = time.perf_counter() - start
    names = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana"]
    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"A JSON record for {names[i % 8]} number {i}: name, age, role, skills."}],
        tokenize=False, add_generation_prompt=True) for i in range(n)]
    constrained = SamplingParams(max_tokens=160, temperature=0.0, structured_outputs={"json": PERSON_SCHEMA})
    lengths = [len(o.token_ids) for o in llm.generate(prompts, constrained)]  # also the warm-up
    plain = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in lengths]
    seconds = alternating({"unconstrained": lambda: timed(llm.generate, prompts, plain),
                           "constrained": lambda: timed(llm.generate, prompts, constrained)}, repeats)
    runs = {label: statistics.median(times) for label, times in seconds.items()}
    tokens = sum(lengths)
    result = {"requests": n, "tokens": tokens, "info_s": info_s, **{f"compile_{k}_s": v for k, v in timings.items()},
              **{f"{k}_tok_s": tokens / v for k, v in runs.items()}}
    print(f"  structured outputs: {result}", file=sys.stderr)
    return result


def bench_detokenize(model_dir: str, streams: int = 128, steps: int = 64) -> dict[str, float]:
    """Host time per engine step to turn one new token of each of `streams` sequences into text, through
    the tokenizer (a decode window per sequence) and through the byte table; milliseconds per step,
    median of the steps. The tokens are those of real text, so that multi-byte characters split."""
    import threading

    from transformers import AutoTokenizer

    from inflight.detokenizer import IncrementalDetokenizer, TokenBytes

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = (Path(ROOT / "README.md").read_text() + " 你好，世界 🌍🚀 naïve café — ") * 4
    ids = tokenizer.encode(text, add_special_tokens=False)
    table = TokenBytes.build(tokenizer)
    result = {}
    for label, token_bytes in (("through the tokenizer", None), ("byte table", table)):
        if label == "byte table" and table is None:
            continue
        lock = threading.Lock()
        detoks = [IncrementalDetokenizer(tokenizer, ids[:8], True, lock, token_bytes) for _ in range(streams)]
        times = []
        for step in range(steps):
            start = time.perf_counter()
            for k, detok in enumerate(detoks):
                detok.add_tokens([ids[(k * 97 + step) % len(ids)]])
            times.append(time.perf_counter() - start)
        result[label] = 1000 * statistics.median(times)
    print(f"  detokenize: {result}", file=sys.stderr)
    return result


SAMPLING_CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 1, top_p 0.95": dict(temperature=1.0, top_p=0.95),
    "temperature 1, top_k 50": dict(temperature=1.0, top_k=50),
    "temperature 1, min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "greedy, repetition_penalty 1.1": dict(temperature=0.0, repetition_penalty=1.1),
    "greedy, presence and frequency penalties 0.5": dict(temperature=0.0, presence_penalty=0.5,
                                                         frequency_penalty=0.5),
    # Penalties read every token a sequence has seen: at long contexts that is most of their cost.
    "greedy, repetition_penalty 1.1, 2,048 tokens seen": dict(temperature=0.0, repetition_penalty=1.1, seen=2048),
    "greedy, logit_bias on 100 tokens": dict(temperature=0.0, logit_bias={t: 1.5 for t in range(1000, 1100)}),
    "greedy, 1,000 allowed_token_ids": dict(temperature=0.0, allowed_token_ids=list(range(1000, 2000))),
}


def bench_sampling(model_dir: str, rows: int = 128, calls: int = 10) -> dict[str, float]:
    """Milliseconds the sampler takes for one decode step of `rows` sequences under each case of
    `SAMPLING_CASES` (median of `calls`): the logits are the default model's own at `rows` positions of
    real text (the filters' cost depends on how peaked they are), each sequence having the 256 tokens
    before its position as prompt and 32 as output (a case's `seen`: that many tokens before it in all,
    the text looping round), kept as the engine keeps them for penalties (token_history.py)."""
    from transformers import AutoTokenizer

    from inflight import SamplingParams
    from inflight.sampler import sample
    from inflight.sequence import Sequence
    from inflight.token_history import TokenHistory

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(Path(ROOT / "README.md").read_text(), add_special_tokens=False)[:1024]
    model = load_hf(model_dir)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    positions = torch.linspace(300, len(ids) - 1, rows).long().tolist()
    logits = logits[positions]
    looped, end = ids * 4, 3 * len(ids)  # looped[end + p] is ids[p]
    result = {}
    for name, settings in SAMPLING_CASES.items():
        settings = dict(settings)
        seen = settings.pop("seen", 288)
        params = SamplingParams(**settings)
        seqs = [Sequence(str(i), looped[end + p - seen:end + p - 32], params, None,
                         output_token_ids=looped[end + p - 32:end + p], step_row=i) for i, p in enumerate(positions)]
        history = _token_history(TokenHistory, seqs, logits.shape[-1])
        times = []
        for _ in range(calls):
            fresh = logits.clone()  # sampling changes its logits in place
            times.append(timed(lambda *args: sample(*args, history=history), fresh, seqs, [tokenizer.eos_token_id]))
        result[name] = 1000 * statistics.median(times)
    print(f"  sampling: {result}", file=sys.stderr)
    return result


def _token_history(history_class, seqs: list, vocab: int, block_size: int = 16):
    """A step's record of `seqs`' tokens as a forward pass leaves it: each sequence in blocks of its own."""
    per_seq = -(-max(len(s.token_ids) for s in seqs) // block_size)
    history = history_class(len(seqs) * per_seq, block_size, vocab, torch.device("cpu"))
    tables = torch.arange(len(seqs) * per_seq).view(len(seqs), per_seq)
    for row, seq in enumerate(seqs):
        slots = row * per_seq * block_size + torch.arange(len(seq.token_ids))
        history.write(slots, torch.tensor(seq.token_ids))
    history.step_ran(tables, np.array([len(s.token_ids) for s in seqs]))
    return history


def bench_tensor_parallel(model_dir: str, work: Workload, threads: int, repeats: int) -> list[tuple]:
    """The workload offline on 1 rank (all `threads`) and on 3 ranks (processes of one thread each):
    output tok/s (medians of alternating runs), mean step time, and rank 0's per-step message to the
    other ranks (pickling and sending it: milliseconds, bytes)."""
    from inflight import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
    configs = {1: dict(num_threads=threads), 3: dict(num_threads=1, tensor_parallel_size=3)}
    llms = {ranks: make_llm(model_dir, num_kv_blocks=1024, **settings) for ranks, settings in configs.items()}
    expected = None
    steps = {}  # ranks -> (steps, seconds) of its last run

    def run(ranks: int) -> float:
        nonlocal expected
        llm = llms[ranks]
        before, start = llm.num_steps, time.perf_counter()
        tokens = [o.token_ids for o in llm.generate(work.prompts, params)]
        seconds = time.perf_counter() - start
        steps[ranks] = (llm.num_steps - before, seconds)
        assert expected is None or tokens == expected, "tensor parallelism changed the greedy output"
        expected = tokens
        return seconds

    try:
        seconds = alternating({ranks: lambda ranks=ranks: run(ranks) for ranks in configs}, repeats)
        rows = []
        for ranks, times in seconds.items():
            runner = llms[ranks].runner
            count, last = steps[ranks]
            message = (f"{1000 * runner.step_message_seconds / runner.step_messages:.3f} ms, "
                       f"{runner.step_message_bytes / runner.step_messages / 1024:.1f} KiB") if ranks > 1 else "-"
            rows.append((ranks, configs[ranks].get("num_threads"), work.output_tokens / statistics.median(times),
                         1000 * last / count, message))
        print(f"  tensor parallelism: {rows}", file=sys.stderr)
        return rows
    finally:
        for llm in llms.values():
            llm.close()


def print_long_prompts(r: dict, what: str, repeats: int, labels: dict) -> None:
    print(f"\n| {r['requests']} prompts of 1,536-2,048 tokens, 64 out, {what}, median of {repeats} | output tok/s | "
          "most sequences at once | preemptions |\n|---|---:|---:|---:|")
    for way, label in labels.items():
        print(f"| {label} | {r['rates'][way]:.1f} | {r['peaks'][way]} | {r['preemptions'][way]} |")
    print(f"\ngreedy outputs identical both ways: {r['same']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peers",
                        default="hf-static,hf-cb,inflight,triton,prefix,structured,logprobs,n,lora,beams,spec,tp,"
                                "detok,sampling,attention,kv-dtype,window,hybrid,moe",
                        help="comma-separated: hf-static, hf-cb, inflight, triton, prefix, structured, logprobs, n, "
                             "lora (the cost of serving two LoRA adapters, by name and as LoRA tasks), beams (beam "
                             "search against HF generate's), spec (n-gram speculative decoding against HF's prompt "
                             "lookup), draft (a draft model's speculative decoding, --draft-model, against HF's "
                             "assisted generation with it; not run unless named), tp (tensor parallelism: 1 and 3 "
                             "ranks), detok (detokenizing 128 streams), sampling (the sampler's cost for 128 streams), "
                             "attention (the CPU attention kernels against the torch paths, bench_cpu_attention.py), "
                             "kv-dtype (bfloat16 and fp8 KV caches against the model's float32 one), offload (turns of "
                             "conversations whose contexts the pool cannot hold at once: the pool alone and with a "
                             "host tier, kv_offload_memory; not run unless named), quantized (the "
                             "model's compressed-tensors FP8-dynamic and W4A16 copies against it; not run unless "
                             "named), window (long prompts on a model whose layers share a sliding window: blocks "
                             "behind it given back or kept), hybrid (long prompts on a model of Gemma 3's windowed and "
                             "full layers: the windowed ones' block tables of their own or one table for all), moe (a "
                             "mixture-of-experts model's experts packed or as transformers runs them)")
    parser.add_argument("--draft-model", default=None,
                        help="the draft model of the draft peer: a folder of a model with the same tokenizer "
                             "(default: the model itself, whose drafts are all kept)")
    parser.add_argument("--tp-requests", type=int, default=16, help="requests of the tensor-parallel comparison")
    parser.add_argument("--hf-static-batch", type=int, default=8)
    parser.add_argument("--hf-cb-tokens", default="256,512", help="HF continuous batching token budgets to try")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of inflight offline and through tritonserver, alternating; medians are shown")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peers = args.peers.split(",")
    work = make_workload(args.num_requests, args.seed)
    print(f"workload: {args.num_requests} requests, prompts 16-512 tokens, outputs 16-256 tokens "
          f"({work.output_tokens} output tokens), EOS ignored, float32, {args.threads} threads", file=sys.stderr)

    results: list[tuple[str, float]] = []

    def record(name: str, seconds: float) -> None:
        results.append((name, work.output_tokens / seconds))
        print(f"  {name}: {work.output_tokens / seconds:.1f} tok/s ({seconds:.1f} s)", file=sys.stderr)

    def record_median(name: str, runs: list[float]) -> None:
        record(f"{name}, median of {len(runs)}" if len(runs) > 1 else name, statistics.median(runs))

    if "hf-static" in peers:
        record(f"HF static batching (generate, batches of {args.hf_static_batch})",
               run_hf_static(load_hf(args.model), work, args.hf_static_batch))
    if "hf-cb" in peers:
        for tokens in map(int, args.hf_cb_tokens.split(",")):
            record(f"HF continuous batching (max_batch_tokens={tokens})",
                   run_hf_continuous(load_hf(args.model), work, tokens))
    # Offline and served runs alternate, so that a slow spell of a shared machine hits both alike.
    runs = {}
    if "inflight" in peers:
        runs["offline"] = lambda: run_inflight(args.model, work, max_num_batched_tokens=args.max_num_batched_tokens)
    if "triton" in peers:
        from triton_bench import run_through_tritonserver

        runs["served"] = lambda: run_through_tritonserver(args.model, work, args.threads, args.max_num_batched_tokens)
    seconds = alternating(runs, args.repeats)
    offline, served = seconds.get("offline", []), seconds.get("served", [])
    if offline:
        record_median(f"inflight offline (max_num_batched_tokens={args.max_num_batched_tokens})", offline)
    if served:
        record_median(f"inflight through tritonserver (gRPC streaming, all {args.num_requests} requests at once)",
                      served)
    if offline:
        processed = sum(map(len, work.prompts)) + work.output_tokens
        rate = processed / statistics.median(offline)
        dense, how = dense_forward_rate(args.model)
        processing_line = (f"engine processing rate: {rate:.0f} tokens/s (prompt + output tokens over the offline "
                           f"run, median) = {rate / dense:.0%} of one dense 256-token forward ({dense:.0f} tokens/s "
                           f"{how})")
        print(f"  {processing_line}", file=sys.stderr)
    for name, runs in (("offline", offline), ("through tritonserver", served)):
        if len(runs) > 1:
            print(f"  inflight {name}, each run: " + ", ".join(f"{work.output_tokens / t:.1f}" for t in runs)
                  + " tok/s", file=sys.stderr)

    if results:
        hf_cb = [tps for name, tps in results if name.startswith("HF continuous")]
        best_cb = max(hf_cb) if hf_cb else None
        print("\n| system | output tok/s | vs best HF continuous batching |\n|---|---:|---:|")
        for name, tps in results:
            ratio = f"{tps / best_cb:.2f}x" if best_cb else "-"
            print(f"| {name} | {tps:.1f} | {ratio} |")
        if offline and served:
            share = statistics.median(offline) / statistics.median(served)
            print(f"\nthrough tritonserver: {share:.1%} of offline throughput (medians)")
        if offline:
            print(f"\n{processing_line}")
    if "prefix" in peers:
        rows = bench_prefix_caching(args.model, args.num_requests, args.seed)
        print(f"\n| workload ({args.num_requests} requests, 32 output tokens) | prefix caching | mean TTFT (s) | "
              "output tok/s | hit tokens |")
        print("|---|---|---:|---:|---:|")
        for name, caching, ttft, tps, hit in rows:
            print(f"| {name} | {caching} | {ttft:.2f} | {tps:.1f} | {hit} |")
    if "offload" in peers:
        rows = bench_kv_offload(args.model, args.num_requests, args.seed)
        print("", *kv_offload_table(rows, f"{args.num_requests} turns of 8 conversations (400-token contexts, 32 "
                                          "output tokens), a pool of 64 blocks"), sep="\n")
    if "logprobs" in peers:
        seconds = alternating({k: lambda k=k: run_inflight(args.model, work, logprobs=k,
                                                           max_num_batched_tokens=args.max_num_batched_tokens)
                               for k in (None, 5)}, args.repeats)
        plain, with_logprobs = (work.output_tokens / statistics.median(times) for times in seconds.values())
        print(f"\n| inflight offline, median of {args.repeats} | output tok/s |\n|---|---:|\n"
              f"| without logprobs | {plain:.1f} |\n"
              f"| logprobs=5 on every request | {with_logprobs:.1f} ({1 - with_logprobs / plain:+.1%} cost) |")
    if "kv-dtype" in peers:
        r = bench_kv_cache_dtype(args.model, work, args.repeats, args.max_num_batched_tokens)
        plain = r["rates"]["auto"]
        print(f"\n| KV cache (kv_cache_dtype), inflight offline, median of {args.repeats} | output tok/s | "
              f"KV tokens a GiB holds | greedy outputs equal to the float32 cache's |\n|---|---:|---:|---|\n"
              f"| float32, the model's dtype (auto) | {plain:.1f} | {r['tokens_per_gib']['auto']:,} | |")
        for kv in KV_DTYPES[1:]:
            rate = r["rates"][kv]
            print(f"| {kv} | {rate:.1f} ({rate / plain - 1:+.1%}) | {r['tokens_per_gib'][kv]:,} | "
                  f"{r['same'][kv]} of {r['requests']} (on average the first {r['leading'][kv]:.0%} of a "
                  "request's tokens) |")
    if "quantized" in peers:
        r = bench_quantized(args.model, work, args.repeats, args.max_num_batched_tokens)
        plain = r["rates"][None]
        print(f"\n| checkpoint, inflight offline on a CPU (dequantized as it loads), median of {args.repeats} | "
              f"output tok/s | greedy outputs equal to the unquantized model's |\n|---|---:|---|\n"
              f"| unquantized, float32 | {plain:.1f} | |")
        for fmt, name in QUANTIZED.items():
            rate = r["rates"][fmt]
            print(f"| {name} | {rate:.1f} ({rate / plain - 1:+.1%}) | {r['same'][fmt]} of {r['requests']} (on "
                  f"average the first {r['leading'][fmt]:.0%} of a request's tokens) |")
    if "window" in peers:
        r = bench_sliding_window(args.model, args.repeats, args.max_num_batched_tokens, args.seed)
        print_long_prompts(r, f"a window of {r['window']} in every layer, {r['blocks']} blocks of 16", args.repeats,
                           {False: "blocks behind the window kept", True: "given back (the engine's way)"})
    if "hybrid" in peers:
        r = bench_hybrid_tables(args.model, args.repeats, args.max_num_batched_tokens, args.seed)
        print_long_prompts(r, f"Gemma 3's layers (25 within a window of {r['window']}, 5 full), "
                              f"{r['memory'] / 2**20:.0f} MiB of KV cache", args.repeats,
                           {False: "one block table for every layer",
                            True: "the windowed layers' own (the engine's way)"})
    if "moe" in peers:
        for dtype in ("float32", "bfloat16"):
            r = bench_mixture_of_experts(args.model, work, args.repeats, dtype)
            (label, packed), (_, plain) = r["rates"].items()
            print(f"\n| mixture of experts (8 layers of 8 experts, 2 per token), {r['requests']} requests, {dtype}, "
                  f"median of {args.repeats} | prompt + output tokens/s |\n|---|---:|\n"
                  f"| transformers' experts | {plain:,.0f} |\n| {label} | {packed:,.0f} ({packed / plain:.2f}x) |\n\n"
                  f"greedy outputs equal: {r['same']} of {r['requests']}")
    if "n" in peers:
        r = bench_n_completions(args.model, work, args.repeats)
        print(f"\n| {len(work.prompts) // 4} prompts x 4 completions, median of {args.repeats} | output tok/s |\n"
              f"|---|---:|\n| 4 separate requests per prompt | {r['4 separate requests']:.1f} |\n"
              f"| one request with n=4 (the prompt computed once) | {r['n=4']:.1f} "
              f"({r['n=4'] / r['4 separate requests']:.2f}x) |")
    if "lora" in peers:
        r = bench_lora(args.model, work, args.repeats)
        base = r["no adapters"]
        print(f"\n| {max(3, len(work.prompts) // 4)} requests, median of {args.repeats} | output tok/s |\n|---|---:|")
        for label, tps in r.items():
            print(f"| {label} | {tps:.1f}" + ("" if label == "no adapters" else f" ({tps / base - 1:+.1%})") + " |")
    if "beams" in peers:
        r = bench_beam_search(args.model, work, args.repeats)
        print(f"\n| {r['prompts']} beam searches (width 4, 32 tokens), median of {args.repeats} | searches/s |\n"
              f"|---|---:|\n| HF generate(num_beams=4), one prompt at a time | {r['hf']:.2f} |\n"
              f"| HF generate(num_beams=4), all prompts in one left-padded batch | {r['hf-batch']:.2f} |\n"
              f"| inflight, all at once | {r['inflight']:.2f} ({r['inflight'] / r['hf']:.2f}x) |\n\n"
              f"best beam equal to HF's: {r['same']} of {r['prompts']}")
    draft_folder = args.draft_model or args.model
    drafters = {"spec": None, "draft": (draft_folder, os.path.basename(os.path.normpath(draft_folder)))}
    for draft in [drafters[peer] for peer in drafters if peer in peers]:
        for name, tasks in (("editing tasks", EDITING_TASKS), ("open questions", OPEN_QUESTIONS)):
            r = bench_speculative(args.model, tasks, args.repeats, draft_model=draft)
            print(f"\n| {r['requests']} {name}, greedy, {r['tokens']} output tokens, median of {args.repeats} | "
                  "output tok/s | outputs equal to HF generate's |\n|---|---:|---:|")
            for label, rate, equal in r["rows"]:
                print(f"| {label} | {rate:.1f} | {equal} of {r['requests']} |")
            print(f"\ndrafts kept: {r['kept']:.0%}; tokens per step of a drafting sequence: "
                  f"{r['tokens_per_draft_step']:.2f}")
    if "structured" in peers:
        r = bench_structured_outputs(args.model, args.num_requests, args.repeats)
        cost = 1 - r["constrained_tok_s"] / r["unconstrained_tok_s"]
        print(f"\n| {r['requests']} requests, {r['tokens']} output tokens | output tok/s |\n|---|---:|")
        print(f"| unconstrained (cut to the constrained lengths), median of {args.repeats} | "
              f"{r['unconstrained_tok_s']:.1f} |")
        print(f"| all under one JSON schema, median of {args.repeats} | {r['constrained_tok_s']:.1f} "
              f"({cost:+.1%} cost) |")
        print(f"\ntokenizer info built in {r['info_s'] * 1000:.0f} ms; schema compiled cold in "
              f"{r['compile_cold_s'] * 1000:.1f} ms, cached in {r['compile_cached_s'] * 1000:.2f} ms")
    if "detok" in peers:
        r = bench_detokenize(args.model)
        print("\n| detokenizing one token of each of 128 streams | host ms per step (median of 64) |\n|---|---:|")
        for label, ms in r.items():
            print(f"| {label} | {ms:.2f} |")
    if "sampling" in peers:
        r = bench_sampling(args.model)
        print("\n| sampling one token for each of 128 streams (the model's logits on real text) | ms per step "
              "(median of 10) |\n|---|---:|")
        for label, ms in r.items():
            print(f"| {label} | {ms:.2f} |")
    if "attention" in peers:
        import bench_cpu_attention

        for shape in bench_cpu_attention.SHAPES:
            bench_cpu_attention.print_table(shape, bench_cpu_attention.bench(shape, calls=20), args.threads)
        bench_cpu_attention.print_span_table(bench_cpu_attention.span_rows(calls=20), args.threads)
    if "tp" in peers:
        subset = Workload(work.prompts[:args.tp_requests], work.output_lens[:args.tp_requests])
        rows = bench_tensor_parallel(args.model, subset, args.threads, args.repeats)
        print(f"\n| {len(subset.prompts)} requests, {subset.output_tokens} output tokens, median of {args.repeats} "
              "| threads per rank | output tok/s | mean step | rank 0's message per step |")
        print("|---|---:|---:|---:|---:|")
        for ranks, threads, tps, step_ms, message in rows:
            print(f"| tensor_parallel_size {ranks} | {threads} | {tps:.1f} | {step_ms:.1f} ms | {message} |")


if __name__ == "__main__":
    main()
