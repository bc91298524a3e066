"""Stream a prompt's tokens from the `llm` model over gRPC (tritonclient), live.

    .venv/bin/python client/grpc_stream.py "Tell me about Mars" --max-tokens 64 --chat

Prints the text as it arrives, then time to first token and tokens/s.
"""

import argparse
import base64
import json
import queue
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parents[1]

_TYPES = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32)}


def make_inputs(prompt: str | None, stream: bool = True, sampling_parameters: dict | str | None = None, **tensors):
    """Triton inputs for one request: `text_input` (unless `prompt` is None), `stream`, optional JSON
    `sampling_parameters` and any other input as a keyword (its type inferred: bool -> BOOL, int ->
    INT32, float -> FP32, str/bytes -> BYTES, list of str -> BYTES [n]; a numpy array is sent as it is)."""
    def tensor(name, array, datatype):
        t = grpcclient.InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        return t

    inputs = [tensor("stream", np.array([stream]), "BOOL")]
    if prompt is not None:  # None: the prompt comes as input_ids
        inputs.insert(0, tensor("text_input", np.array([prompt.encode() if isinstance(prompt, str) else prompt],
                                                       dtype=np.object_), "BYTES"))
    if sampling_parameters is not None:  # a dict is sent as JSON, a string as it is
        raw = sampling_parameters if isinstance(sampling_parameters, str) else json.dumps(sampling_parameters)
        inputs.append(tensor("sampling_parameters", np.array([raw.encode()], dtype=np.object_), "BYTES"))
    for name, value in tensors.items():
        if isinstance(value, np.ndarray):
            datatype = "BYTES" if value.dtype == np.object_ else grpcclient.np_to_triton_dtype(value.dtype)
            inputs.append(tensor(name, value, datatype))
        elif isinstance(value, list):
            inputs.append(tensor(name, np.array([v.encode() for v in value], dtype=np.object_), "BYTES"))
        elif isinstance(value, (str, bytes)):
            inputs.append(tensor(name, np.array([value.encode() if isinstance(value, str) else value],
                                                dtype=np.object_), "BYTES"))
        else:
            datatype, dtype = _TYPES[type(value)]
            inputs.append(tensor(name, np.array([value], dtype=dtype), datatype))
    return inputs


@dataclass
class StreamResult:
    chunks: list[str] = field(default_factory=list)
    error: str | None = None
    finish_reason: str | None = None
    first_token_s: float | None = None
    total_s: float = 0.0
    outputs: dict = field(default_factory=dict)  # the last response's other outputs
    responses: list[dict] = field(default_factory=list)  # every response's outputs, as numpy arrays

    @property
    def text(self) -> str:
        return "".join(self.chunks)


def generate(url: str, prompt: str, timeout: float = 300.0, on_text=None, model: str = "llm",
             cancel_after: int | None = None, outputs: list[str] | None = None, cancel_after_s: float | None = None,
             **inputs) -> StreamResult:
    """Send one request on its own gRPC stream and collect its responses. With `cancel_after`, the
    stream is cancelled after that many responses, with `cancel_after_s` after that many seconds (a
    beam search sends nothing before its end); `outputs` names the outputs wanted (default: all)."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    result = StreamResult()
    start = time.perf_counter()
    try:
        client.async_stream_infer(model, make_inputs(prompt, **inputs), request_id=uuid.uuid4().hex,
                                  enable_empty_final_response=True,
                                  outputs=outputs and [grpcclient.InferRequestedOutput(name) for name in outputs])
        deadline = None if cancel_after_s is None else start + cancel_after_s
        while True:
            try:
                response, error = responses.get(timeout=timeout if deadline is None
                                                else max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                if deadline is None or time.perf_counter() < deadline:
                    raise
                client.stop_stream(cancel_requests=True)
                result.error = "cancelled"
                break
            if error is not None:
                result.error = str(error)
                break
            final = response.get_response().parameters["triton_final_response"].bool_param
            names = [output.name for output in response.get_response().outputs]
            if names:
                result.responses.append({name: response.as_numpy(name) for name in names})
            text = response.as_numpy("text_output")
            if text is not None and text.size:
                chunk = text.reshape(-1)[0].decode("utf-8")
                if chunk and result.first_token_s is None:
                    result.first_token_s = time.perf_counter() - start
                result.chunks.append(chunk)
                if on_text:
                    on_text(chunk)
                for name in ("finish_reason", "num_input_tokens", "num_output_tokens"):
                    value = response.as_numpy(name)
                    if value is not None:
                        value = value.reshape(-1)[0]
                        result.outputs[name] = value.decode() if isinstance(value, bytes) else int(value)
            if final:
                result.finish_reason = result.outputs.get("finish_reason")
                break
            if cancel_after is not None and len(result.chunks) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                result.error = "cancelled"
                break
    finally:
        result.total_s = time.perf_counter() - start
        client.stop_stream()
        client.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--tokenizer", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--sampling-parameters", metavar="JSON",
                        help="more sampling parameters, with vLLM's names (a JSON object), e.g. "
                             '\'{"logit_bias": {"19081": -100}, "stop": ["."]}\'')
    parser.add_argument("--lora-task-id", type=int, help="TensorRT-LLM's LoRA task of the request (the server needs "
                        "lora_task_slots): sent with --lora-dir the first time, alone after")
    parser.add_argument("--lora-dir", help="a peft LoRA adapter folder, sent as the task's lora_weights and "
                        "lora_config")
    parser.add_argument("--image", action="append", default=[], metavar="FILE",
                        help="an image file (PNG, JPEG, ...) for a vision-language model, sent base64-encoded as "
                        "vllm_backend's `image` input; repeat it for several, each where a placeholder of the "
                        "prompt (<image> for LLaVA and PaliGemma, <start_of_image> for Gemma 3) says")
    args = parser.parse_args()
    prompt = args.prompt
    if args.chat:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.sampling_parameters:
        try:
            given = json.loads(args.sampling_parameters)
        except json.JSONDecodeError as e:
            sys.exit(f"error: --sampling-parameters is not valid JSON: {e}")
        if not isinstance(given, dict):
            sys.exit("error: --sampling-parameters must be a JSON object")
        sampling.update(given)
    lora = {}
    if args.lora_dir and args.lora_task_id is None:
        sys.exit("error: --lora-dir goes with --lora-task-id")
    if args.lora_task_id is not None:
        lora["lora_task_id"] = np.array([args.lora_task_id], np.uint64)
    if args.lora_dir:
        from lora_adapters import trtllm_lora_tensors

        lora["lora_weights"], lora["lora_config"] = trtllm_lora_tensors(args.lora_dir, np.float16)
    extra = dict(lora)
    if args.image:
        extra["image"] = [base64.b64encode(Path(path).read_bytes()).decode() for path in args.image]
    result = generate(args.url, prompt, on_text=lambda t: print(t, end="", flush=True), sampling_parameters=sampling,
                      return_num_output_tokens=True, return_finish_reason=True, **extra)
    print()
    if result.error:
        sys.exit(f"error: {result.error}")
    tokens = result.outputs.get("num_output_tokens", 0)
    decode_s = result.total_s - (result.first_token_s or 0)
    rate = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0
    print(f"\n[{tokens} tokens, finish_reason={result.finish_reason}, time to first token "
          f"{(result.first_token_s or 0) * 1000:.0f} ms, {rate:.1f} tokens/s after it]", file=sys.stderr)


if __name__ == "__main__":
    main()
