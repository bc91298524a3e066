"""LLM: the engine plus an offline `generate()`."""

import itertools

from tqdm.auto import tqdm

from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM(LLMEngine):
    _ids = itertools.count()

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in the order of `prompts`."""
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        else:
            params = [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for k, (request_id, prompt, p) in enumerate(zip(ids, prompts, params)):
            try:
                self.add_request(request_id, prompt, p)
            except ValueError as e:
                for queued in ids[:k]:  # leave nothing behind for a batch that is refused
                    self.abort(queued)
                while self.has_unfinished():
                    self.step()
                raise ValueError(f"prompt {k}: {e}") from None
        token_ids: dict[str, list[int]] = {i: [] for i in ids}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        reasons: dict[str, str] = {}
        errors: dict[str, str] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while len(reasons) < len(ids):
            for delta in self.step():
                token_ids[delta.request_id] += delta.new_token_ids
                texts[delta.request_id].append(delta.new_text)
                if delta.finished:
                    reasons[delta.request_id] = delta.finish_reason
                    if delta.error is not None:
                        errors[delta.request_id] = delta.error
                    bar.update(1)
        bar.close()
        prompt_ids = [p if isinstance(p, list) else self.encode(p) for p in prompts]
        return [RequestOutput(i, prompt_ids[k], token_ids[i], "".join(texts[i]), reasons[i], errors.get(i))
                for k, i in enumerate(ids)]
