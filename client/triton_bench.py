"""The benchmark workload sent through a real tritonserver: every request on its own gRPC stream, all
at once (concurrency = number of requests)."""

import threading
import time

from grpc_stream import generate
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
        produced = [0] * len(texts)

        def one(i: int) -> None:
            result = generate(server.grpc_url, texts[i], max_tokens=work.output_lens[i], temperature=0.0,
                              ignore_eos=True, exclude_input_in_output=True, return_num_output_tokens=True)
            if result.error:
                raise RuntimeError(result.error)
            produced[i] = result.outputs["num_output_tokens"]

        workers = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - start
    if sum(produced) != work.output_tokens:
        raise RuntimeError(f"the server produced {sum(produced)} tokens, expected {work.output_tokens}")
    return elapsed
