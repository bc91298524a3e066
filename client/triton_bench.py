"""The benchmark workload sent through a real tritonserver: all requests at once on one gRPC stream
(as perf_analyzer does), so the client costs the 2-core machine as little as possible."""

import queue
import time

import tritonclient.grpc as grpcclient

from grpc_stream import generate, make_inputs
from server_process import TritonServer


def run_through_tritonserver(model_dir: str, work, threads: int, max_num_batched_tokens: int = 512) -> float:
    """Seconds to serve `work`. Prompts travel as text (the token ids decoded), so their re-encoded
    lengths can differ by a token or two; output lengths are exact (max_tokens, EOS ignored)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [tokenizer.decode(p) for p in work.prompts]
    settings = dict(model=model_dir, num_kv_blocks=4096, kv_cache_memory=None, num_threads=threads,
                    max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=64)
    with TritonServer(**settings) as server:
        generate(server.grpc_url, "warm-up", max_tokens=2)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        start = time.perf_counter()
        for i, text in enumerate(texts):
            inputs = make_inputs(text, max_tokens=work.output_lens[i], temperature=0.0, ignore_eos=True,
                                 exclude_input_in_output=True, return_num_output_tokens=True)
            client.async_stream_infer("llm", inputs, request_id=str(i), enable_empty_final_response=True)
        produced = {}
        while len(produced) < len(texts):
            result, error = responses.get(timeout=600)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                produced[response.id] = int(result.as_numpy("num_output_tokens")[0])
        elapsed = time.perf_counter() - start
        client.stop_stream()
        client.close()
    if sum(produced.values()) != work.output_tokens:
        raise RuntimeError(f"the server produced {sum(produced.values())} tokens, expected {work.output_tokens}")
    return elapsed
