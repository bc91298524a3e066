"""LLM: the engine plus an offline `generate()`."""

import itertools

import numpy as np
from tqdm.auto import tqdm

from .engine import LLMEngine
from .lora_tasks import LoRATask
from .outputs import CompletionOutput, RequestDelta, RequestOutput, coalesce
from .sampling_params import SamplingParams


class LLM(LLMEngine):
    _ids = itertools.count()

    def generate(self, prompts: list[str] | list[list[int]] | list[dict],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: list[int] | None = None,
                 lora_name: str | list[str | None] | None = None,
                 lora_task: LoRATask | list[LoRATask | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in the order of `prompts`. `priority`:
        one per prompt, lower served earlier. `lora_name`: the LoRA adapter of every prompt, or one per
        prompt (None: the base model); or `lora_task`, TensorRT-LLM's adapter sent with requests, for
        every prompt or one per prompt. A prompt is text, token ids, or a dict of embeddings (add_request)."""
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        else:
            params = [params or SamplingParams()] * len(prompts)
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        adapters = list(lora_name) if isinstance(lora_name, list) else [lora_name] * len(prompts)
        tasks = list(lora_task) if isinstance(lora_task, list) else [lora_task] * len(prompts)
        if len(adapters) != len(prompts) or len(tasks) != len(prompts):
            raise ValueError(f"got {len(adapters)} LoRA adapter names and {len(tasks)} LoRA tasks for "
                             f"{len(prompts)} prompts")
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        prompt_ids = []
        for k, (request_id, prompt, p) in enumerate(zip(ids, prompts, params)):
            try:
                # (each completion in one delta, at its end: no delta a step and token to build and join)
                prompt_ids.append(self.add_request(request_id, prompt, p, priority[k], adapters[k], final_only=True,
                                                   lora_task=tasks[k]))
            except ValueError as e:
                for queued in ids[:k]:  # leave nothing behind for a batch that is refused
                    self.abort(queued)
                while self.has_unfinished():
                    self.step()
                raise ValueError(f"prompt {k}: {e}") from None
        steps: list[list[RequestDelta]] = []
        finished = 0
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while finished < len(ids):
            steps.append(self.step())
            done = sum(delta.finished for delta in steps[-1])
            finished += done
            bar.update(done)
        bar.close()
        by_request: dict[str, list[RequestDelta]] = {request_id: [] for request_id in ids}
        for delta in coalesce(steps):  # one delta per completion
            by_request.get(delta.request_id, []).append(delta)
        outputs = []
        for k, request_id in enumerate(ids):
            parts = sorted(by_request[request_id], key=lambda d: d.index)
            completions = [CompletionOutput(d.index, d.new_text, d.new_token_ids, d.finish_reason, d.new_logprobs,
                                            d.cumulative_logprob, _stacked(d.new_generation_logits)) for d in parts]
            error = next((d.error for d in parts if d.error), None)
            metrics = next((d.metrics for d in parts if d.metrics), None)
            outputs.append(RequestOutput(request_id, prompt_ids[k], completions, parts[0].prompt_logprobs, error,
                                         metrics=metrics, context_logits=parts[0].context_logits))
        return outputs


def _stacked(rows: list | None):
    """Per-token logits rows as one [tokens, vocab] array (None when not asked for)."""
    if rows is None:
        return None
    return np.stack(rows) if rows else np.zeros((0, 0), np.float32)
