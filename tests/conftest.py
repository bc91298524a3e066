"""Shared fixtures: the default model, tiny random checkpoints of each supported family, and HF
transformers references computed one request at a time."""

import contextlib
import os
import queue
import random
import sys
import threading
import time
import uuid
from pathlib import Path

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before triton is imported.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "client"))  # the clients and helpers the tests share with the benchmarks
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"

# Two torch threads per test process, one each when pytest-xdist runs two (`make test` on 2 cores).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_threads = int(os.environ.get("INFLIGHT_TEST_THREADS", max(1, 2 // _workers)))
torch.set_num_threads(_threads)
# The processes that tests start (benchmarks' smoke runs, kernel scripts, engine processes) get as many
# (OMP_NUM_THREADS): with torch's default of a thread per core, beside the other worker's they took twice
# as long (bench-gpu's smoke run: 52 s beside a busy core, 27 s on one thread).
# Likewise inductor's compiles (torch_compile, fused_layers): one at a time in the test's process, not a
# pool of compile workers started beside the other worker's busy core (the three modules compiling, in two
# workers without inductor's cache: 194 s to 162, 47 CPU seconds less).
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# The engines under test run on the CPU unless a test asks for a GPU (device="cuda"): "auto" would pick
# a GPU where there is one, but the HF references and the served tests' expectations are computed on
# the CPU in float32. Served tests get device "cpu" in their model.json (serve below).
import inflight.config  # noqa: E402

inflight.config.auto_device = lambda: "cpu"

# Tiny checkpoints of each family, small enough to run in milliseconds. initializer_range is raised
# above the usual 0.02 so that logits are peaked: greedy comparisons then test the engine, not
# float32 rounding between two near-equal logits.
TINY_FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=32),
    "mistral": dict(model_type="mistral", sliding_window=48),
}


# More of transformers' model types, in the same tiny size: each with what sets its attention or layers
# apart. Their references are HF's eager attention (its SDPA ignores Gemma 2's softcap and gpt-oss's sinks).
MORE_FAMILIES = {
    "gemma": dict(model_type="gemma", head_dim=16),  # GeGLU, norms of 1 + weight, scaled embeddings
    "gemma2": dict(model_type="gemma2", head_dim=256, sliding_window=48, attn_logit_softcapping=0.5,
                   final_logit_softcapping=3.0),  # softcaps; heads of 256, the C prefill kernel's longest
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16, sliding_window=48,
                        layer_types=["sliding_attention", "full_attention"]),  # query/key norms, two rotaries
    "gpt_oss": dict(model_type="gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2),  # sinks, MoE
    "phi3": dict(model_type="phi3", pad_token_id=0),  # one q/k/v projection
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64),
    "olmo2": dict(model_type="olmo2"),
    "starcoder2": dict(model_type="starcoder2", sliding_window=48),  # LayerNorm, biases
    "gpt2": dict(model_type="gpt2", num_key_value_heads=None),  # absolute positions, no GQA
    "gpt_neox": dict(model_type="gpt_neox", num_key_value_heads=None),  # partial rotary, parallel residual
    "granite": dict(model_type="granite"),  # multipliers
    "cohere": dict(model_type="cohere"),
    "glm4": dict(model_type="glm4", pad_token_id=0),
    "smollm3": dict(model_type="smollm3", pad_token_id=0),  # layers without rotary
    "exaone4": dict(model_type="exaone4", sliding_window=48),
    "llama4_text": dict(model_type="llama4_text", attention_chunk_size=2048),  # chunked: full up to a chunk
    "phi": dict(model_type="phi", num_key_value_heads=None),
}


def make_tiny_model(family: str, out: Path, vocab_size: int = 512, num_attention_heads: int = 4,
                    num_key_value_heads: int = 2, **config) -> Path:
    """`family`'s tiny checkpoint (`config`: settings beyond the family's, e.g. more layers) saved to `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    settings = dict(TINY_FAMILIES.get(family) or MORE_FAMILIES[family])
    model_type = settings.pop("model_type")
    sizes = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                 max_position_embeddings=1024)
    sizes.update(settings, **config)
    config = AutoConfig.for_model(
        model_type, **{k: v for k, v in sizes.items() if v is not None}, initializer_range=0.2,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    )
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    # Any tokenizer works for token-id prompts; the default model's one keeps the tests offline.
    AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def default_model() -> str:
    if not (DEFAULT_MODEL / "config.json").exists():
        pytest.fail(f"{DEFAULT_MODEL} is missing: run `make setup`")
    return str(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: str(make_tiny_model(family, root / family)) for family in TINY_FAMILIES}


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_models):
    """HF transformers' own model of the tiny Llama checkpoint (float32), for references."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()


def random_pool_history(pool, rng, tables, label, adapters=(0,), vocab: int = 6, longest_prefix: int = 30,
                        events: int = 400) -> None:
    """Random events on a block manager `pool`: sequences sharing four prefixes arriving (each of one of
    `adapters`, found in the prefix cache), computed in random chunks, forked and copied on write, preempted,
    finished; every block back at the end. A model of what each block and host slot holds (a tag, and the
    tokens whose KV it holds as written) follows the steps' writes and the pending copies in their order, and
    checks every block the sequence's tables name after every match and step: `tables(seq)` gives each table
    as (its tag, the table, how many blocks it gave back). `label` names the history in a failure."""
    from inflight import SamplingParams
    from inflight.kv_offload import FROM_HOST, ON_DEVICE, TO_HOST
    from inflight.sequence import Sequence

    bs = pool.block_size
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    holds, host = {}, {}  # block id / host slot -> (tag, tokens)
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(1, longest_prefix))] for _ in range(4)]
    live = []

    def copy():
        for source, destination, kind in pool.take_pending_copies():
            if kind == ON_DEVICE:
                holds[destination] = holds[source]
            elif kind == TO_HOST:
                host[destination] = holds[source]
            else:
                assert kind == FROM_HOST
                holds[destination] = host[source]

    def check(seq):
        computed = seq.num_computed_tokens
        for tag, table, released in tables(seq):
            for i in range(released, min(len(table), -(-computed // bs))):
                tokens = tuple(seq.token_ids[:min((i + 1) * bs, computed)])
                held = holds.get(table[i])
                assert held is not None and held[0] == tag and held[1][:len(tokens)] == tokens, (label, tag, i)

    for event in range(events):
        action = rng.random()
        if action < 0.3 or not live:  # a sequence arrives
            tokens = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            seq = Sequence(f"s{event}", tokens, params, detokenizer=None)
            seq.lora_id = rng.choice(adapters)
            pool.match_prefix(seq)
            copy()
            check(seq)
            live.append(seq)
        elif action < 0.8:  # a step of one sequence: its next chunk, or a token more
            seq = rng.choice(live)
            pool.release_behind_window(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(rng.randrange(vocab))
            n = min(rng.randint(1, seq.num_tokens - seq.num_computed_tokens), pool.max_new_tokens(seq))
            if n <= 0 or not pool.allocate(seq, n):
                victim = rng.choice(live)  # preempted
                pool.free(victim)
                live.remove(victim)
                continue
            copy()
            check(seq)  # (a block written in part before, copied on write, holds that part)
            end = seq.num_computed_tokens + n
            for tag, table, _ in tables(seq):
                for i in range(seq.num_computed_tokens // bs, -(-end // bs)):
                    holds[table[i]] = (tag, tuple(seq.token_ids[:min((i + 1) * bs, end)]))
            seq.num_computed_tokens = end
            pool.cache_full_blocks(seq)
            check(seq)
        elif action < 0.9:  # a computed sequence forks
            parent = rng.choice(live)
            if parent.num_computed_tokens == parent.num_tokens:
                child = Sequence(parent.request_id + "+", list(parent.prompt_token_ids), params, detokenizer=None)
                child.output_token_ids, child.lora_id = list(parent.output_token_ids), parent.lora_id
                pool.fork(parent, child)
                live.append(child)
        else:  # one finishes
            seq = rng.choice(live)
            pool.free(seq)
            live.remove(seq)
    for seq in live:
        pool.free(seq)
    pool.check_all_free()


def hybrid_tables(seq) -> list:
    """A sequence's tables under hybrid_blocks.py, for random_pool_history: the full layers' (tag 0) and each
    windowed group's (tag 1 on), with the blocks each gave back behind the window."""
    return [(0, seq.block_table, 0)] + [(g + 1, w.block_table, w.num_released_blocks)
                                        for g, w in enumerate(seq.windows)]


def random_prompts(count: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of lengths spread from min_len to max_len (both included)."""
    rng = random.Random(seed)
    lengths = [min_len, max_len] + [rng.randint(min_len, max_len) for _ in range(count - 2)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, repetition_penalty: float = 1.0,
              presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> list[int]:
    """HF `generate`'s greedy continuation of one prompt, EOS ignored; under its own repetition penalty
    (over prompt and output) and, in a logits processor of ours after it, vLLM's presence and frequency
    penalties (over the output: each token seen less presence, less frequency times its count)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class OutputPenalties(LogitsProcessor):
        def __call__(self, input_ids, scores):
            output = input_ids[0, len(prompt):].tolist()
            for token in set(output):
                scores[0, token] -= output.count(token) * frequency_penalty + presence_penalty
            return scores

    processors = [OutputPenalties()] if presence_penalty or frequency_penalty else []
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, repetition_penalty=repetition_penalty,
                             logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt):].tolist()


class HFReference:
    """Greedy continuations from HF `generate`, one request at a time, memoized per model; `attention`:
    transformers' attention implementation (its default where None)."""

    def __init__(self, attention: str | None = None):
        self._models = {}
        self._cache = {}
        self._attention = {} if attention is None else dict(attn_implementation=attention)

    def __call__(self, model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        from transformers import AutoModelForCausalLM

        key = (model_dir, tuple(prompt), max_new_tokens)
        if key not in self._cache:
            if model_dir not in self._models:
                self._models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                               **self._attention).eval()
            self._cache[key] = hf_greedy(self._models[model_dir], prompt, max_new_tokens)
        return self._cache[key]


class EagerGraph:
    """A captured graph's stand-in on a CPU: a replay runs the forward over what the input buffers hold
    now, into the same output tensor, as a CUDA graph's replay does (through fresh views: the CPU attention
    keeps its plan by the views' identity)."""

    @torch.inference_mode()  # (as StepGraphs.capture: its output an inference tensor, as a CUDA graph's is)
    def __init__(self, graphs, shape):
        self._run = lambda: graphs._forward(graphs.step_tensors(shape))
        graphs.step_tensors(shape, padding=True)
        self.logits = self._run()

    def replay(self):
        self.logits.copy_(self._run())


def graphs_on_a_cpu(llm, max_tokens: int | None = None):
    """The engine's step graphs as capture() makes them on a GPU (up to `max_tokens` tokens of a step with
    prompt chunks: the setting's by default), each an EagerGraph, over input buffers staged as a GPU's
    (host and device buffers apart), so that a CPU runs the steps through the graphs' padded layouts and
    the buffers' copies."""
    from inflight.cuda_graphs import StepGraphs
    from inflight.input_buffers import InputBuffers

    runner = llm.runner
    held = runner.buffers
    runner.buffers = InputBuffers(held.max_tokens, held.max_seqs, held.max_blocks, held.device.device, staged=True,
                                  window_groups=held.window_groups, chunk_width=held.chunk_width,
                                  block_size=runner.block_size)
    graphs = StepGraphs(runner._forward, runner.buffers, runner.config.max_num_seqs, lora=runner.lora is not None,
                        verify_len=runner._verify_len(), verify_seqs=runner._verify_seqs(),
                        max_tokens=runner.config.cuda_graph_max_tokens if max_tokens is None else max_tokens)
    for shape in graphs.shapes():
        graph = EagerGraph(graphs, shape)
        graphs._graphs[shape] = (graph, graph.logits)
    runner.graphs = graphs
    return graphs


@contextlib.contextmanager
def concurrently(calls, timeout: float):
    """Run each call on a thread of its own while the body runs; wait for all of them at the end, and
    re-raise the first exception a call raised (or fail if one is still running after `timeout`)."""
    errors = []

    def guarded(call):
        try:
            call()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(call,)) for call in calls]
    for t in threads:
        t.start()
    yield
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    stuck = sum(t.is_alive() for t in threads)
    assert not stuck, f"{stuck} of {len(threads)} calls still running after {timeout} s"


@contextlib.contextmanager
def running(server):
    """`with running(TritonServer(...)) as server:` starts it, and after the block it stops while the next
    tests run (their servers start on other ports): tritonserver takes ~3 s to stop, mostly its own
    waits. For blocks after which the test reads nothing of the server (`with TritonServer` waits)."""
    server.start()
    try:
        yield server
    finally:
        server.stop_in_background()


def serve(env: dict | None = None, **settings):
    """Body of a module-scoped fixture: a real tritonserver with these engine settings (and extra
    environment variables), which must still be alive when the module's tests are done."""
    from server_process import TritonServer

    settings.setdefault("device", "cpu")
    with running(TritonServer(env=env, **settings)) as server:
        yield server
        assert server.alive(), f"the server died during the tests:\n{server.log()[-3000:]}"


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    return HFReference()


@pytest.fixture(scope="session")
def hf_eager_reference() -> HFReference:
    return HFReference(attention="eager")


@pytest.fixture(scope="session")
def more_tiny_models(tmp_path_factory):
    """The tiny checkpoint of one of MORE_FAMILIES, made on first use."""
    root = tmp_path_factory.mktemp("more-tiny")
    made = {}

    def model(family: str) -> str:
        if family not in made:
            made[family] = str(make_tiny_model(family, root / family))
        return made[family]

    return model


# Prompts and helpers of the served reliability and fault tests.
PROMPTS = ["In 1969, the first humans landed on", "The three primary colors are", "def fibonacci(n):",
           "Photosynthesis is the process by which", "The capital of Japan is", "Water boils at"]


def greedy(max_tokens=16):
    return dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def assert_all_blocks_free(server):
    server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0)
    server.wait_for_metric("inflight_num_requests_running", lambda v: v == 0)
    server.wait_for_metric("inflight_num_requests_waiting", lambda v: v == 0)


def assert_not_ready(server, timeout: float = 60.0):
    """The served model reports not-ready within `timeout` (an engine that stopped unloads it)."""
    deadline = time.monotonic() + timeout
    while server.model_ready() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not server.model_ready(), "the model still reports ready"


def wait_gone(processes: list, timeout: float) -> list:
    """Those of `processes` (psutil's) still running after `timeout` (a zombie has exited: only its parent
    has yet to reap it)."""
    import psutil

    def alive(process):
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    while any(map(alive, processes)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in processes if alive(p)]


@pytest.fixture(scope="session")
def reference(default_model):
    """Greedy texts from the offline engine, with a roomy pool: what every served request must get."""
    from inflight import LLM, SamplingParams

    llm = LLM(default_model, num_kv_blocks=512)
    return lambda prompts, max_tokens: [o.text for o in llm.generate(prompts, SamplingParams(**greedy(max_tokens)))]


def stream_to_the_end(url: str, prompt: str, quiet_s: float = 1.0, **inputs) -> dict:
    """Send one request and keep listening `quiet_s` after its final response: returns its text, its
    error and how many responses came after the final one (there must be none)."""
    import tritonclient.grpc as grpcclient

    from grpc_stream import make_inputs

    client = grpcclient.InferenceServerClient(url)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    client.async_stream_infer("llm", make_inputs(prompt, **inputs), request_id=uuid.uuid4().hex,
                              enable_empty_final_response=True)
    text, error, finals, after_final = [], None, 0, 0
    try:
        while True:
            result, err = events.get(timeout=quiet_s if finals else 300)
            if finals:
                after_final += 1
            if err is not None:
                error, finals = str(err), finals + 1
                continue
            out = result.as_numpy("text_output")
            if out is not None and out.size:
                text.append(out.reshape(-1)[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                finals += 1
    except queue.Empty:
        pass
    finally:
        client.stop_stream()
        client.close()
    return {"text": "".join(text), "error": error, "finals": finals, "after_final": after_final}
