"""Speculative decoding with a draft model (vLLM's "draft_model" method; TensorRT-LLM's draft-target model
inside one engine).

A smaller model of the same tokenizer proposes each decoding sequence's next tokens, greedily, one forward
pass a token for all drafting sequences at once; the model judges them in the step that follows, as it
judges n-gram drafts (speculative.verify: a greedy draft is a one-hot proposal, so every token kept is
distributed as the model's own, and greedy output is the model's token for token).

The draft model's KV cache is a pool of its own with as many blocks as the model's, addressed by the
same block ids: a sequence's block table places its tokens in both, so the block manager, the prefix
cache, copy-on-write and preemption need nothing more (the draft pool copies the blocks the model's
copies). What the draft model holds of a sequence is kept on it (Sequence.draft_model_kv): the tokens it
has computed, and the drafts it computed after them, which hold where they became the sequence's tokens.
Before proposing, it catches up on the rest (a whole prompt, the first time: in chunks within the step's
token budget), so nothing else runs it: blocks found in the prefix cache, a fork's or a preempted
sequence's are computed again from their first token, their values the same.

Steps: the scheduler asks `propose` for a sequence's drafts and gets placeholders, as many as its budget,
blocks, max_tokens and max_model_len allow (the model's step computes the sequence's last token and that
many drafts); the engine's `fill`, before the model's forward, runs the draft model and writes them in,
cut where a grammar would refuse one. Each pass reads the tokens of the one before on the device.
"""

import dataclasses
import logging

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .config import EngineConfig
from .input_buffers import build_step_inputs
from .kv_offload import ON_DEVICE, BlockCopy
from .model_runner import ModelRunner, compute_dtype, kv_bytes_per_block, kv_cache_dtype
from .model_support import UnsupportedModel, kv_heads_and_head_dim
from .scheduler import ScheduledBatch
from .sequence import BlockTable, Sequence
from .speculative import NgramProposer, can_speculate
from .structured_output import grammatical_prefix

logger = logging.getLogger(__name__)

UNFILLED = -1  # a draft the draft model has not proposed yet (the scheduler's placeholder)


class DraftModel:
    """The proposer of speculative_config's "draft_model" method (the scheduler's, as NgramProposer is)."""

    awaits_token = staticmethod(NgramProposer.awaits_token)

    def __init__(self, config: EngineConfig, target: ModelRunner, tokenizer):
        self.config = spec = config.speculative_config
        if target.sliding_window is not None:
            raise ValueError(f"speculative_config's draft model: every layer of {config.model} attends within a "
                             "sliding window, so a sequence gives back its blocks behind it, which the draft "
                             "model would read; use the ngram method")
        _check_tokenizer(tokenizer, spec.model, config.trust_remote_code)
        self.runner = ModelRunner(dataclasses.replace(
            config, model=spec.model, speculative_config=None, num_kv_blocks=target.num_blocks, kv_cache_memory=None,
            kv_cache_memory_fraction=None, max_model_len=target.max_model_len, hybrid_kv_cache=False,
            lora_modules=None, lora_task_slots=0, quantization=None, kv_offload_memory=None,
            fused_layers=None if config.fused_layers else config.fused_layers,
            tensor_parallel_size=1, gpu_device_ids=None, device=str(target.device)))  # (whole, on rank 0's device)
        draft = self.runner
        if draft.image_encoder is not None or draft.chunk_view is not None:
            what = "a vision-language model" if draft.image_encoder is not None else "chunked attention"
            raise UnsupportedModel(f"speculative_config's draft model {spec.model} has {what}: a draft model "
                                   "reads the sequence's tokens alone, through layers that see their whole context")
        self.vocab = min(target.hf_config.vocab_size, draft.hf_config.vocab_size)  # (drafts the model has)
        # Positions it may compute: the model's, or fewer (absolute position embeddings end somewhere)
        self.max_len = min(target.max_model_len,
                           getattr(draft.hf_config, "max_position_embeddings", None) or target.max_model_len)
        self.tables = draft.table_rows
        logger.info("draft model %s: %d drafts a step, a KV pool of %d blocks (%.2f GiB) beside the model's",
                    spec.model, spec.num_speculative_tokens, draft.num_blocks,
                    draft.num_blocks * draft.bytes_per_block / 2**30)

    @staticmethod
    def footprint(config: EngineConfig) -> tuple[int, int]:
        """What the draft model of `config` takes beside the model: its KV's bytes for each block of the pool,
        and its weights' bytes (counted on the meta device, before anything is loaded), so that the model's
        pool leaves room for both."""
        spec = config.speculative_config
        full_config = AutoConfig.from_pretrained(spec.model, trust_remote_code=config.trust_remote_code)
        hf_config = getattr(full_config, "text_config", full_config)
        device_type = config.device_type
        dtype = compute_dtype(config.dtype, full_config, device_type)
        capability = torch.cuda.get_device_capability(config.device) if device_type == "cuda" else None
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype, device_type, capability)
        per_block = kv_bytes_per_block(config.block_size, hf_config.num_hidden_layers,
                                       *kv_heads_and_head_dim(hf_config), kv_dtype)
        try:
            with torch.device("meta"):
                shapes = AutoModelForCausalLM.from_config(full_config, trust_remote_code=config.trust_remote_code)
            weights = sum(p.numel() for p in shapes.parameters()) * dtype.itemsize
        except ValueError:  # no causal language model for it: ModelRunner refuses it by name
            weights = 0
        return per_block, weights

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Placeholders for up to `limit` drafts (num_speculative_tokens at most) that `fill` proposes; none
        where the sequence cannot speculate, or has virtual prompt tokens (embeddings, images), which the
        draft model cannot read."""
        limit = min(limit, self.config.num_speculative_tokens, self.max_len - seq.num_tokens)
        if limit <= 0 or not can_speculate(seq) or seq.prompt_embeds is not None:
            return []
        return [UNFILLED] * limit

    @torch.inference_mode()
    def fill(self, batch: ScheduledBatch, block_copies: list[BlockCopy]) -> None:
        """Before the model's step: copy the blocks it copies, then propose the drafts the scheduler placed
        in `batch`; where a grammar refuses one, the sequence's drafts end before it (and its count of the
        batch's tokens with them)."""
        self.runner.copy_blocks([c for c in block_copies if c.kind == ON_DEVICE])  # (it recomputes cached blocks)
        at = [i for i, seq in enumerate(batch.seqs) if seq.drafts and seq.drafts[0] == UNFILLED]
        if not at:
            return
        seqs = [batch.seqs[i] for i in at]
        for i, seq, drafts in zip(at, seqs, self._draft(seqs)):
            if seq.matcher is not None:
                drafts = drafts[:grammatical_prefix(seq.matcher, drafts)]
            batch.num_tokens[i] -= len(seq.drafts) - len(drafts)
            seq.drafts = drafts

    def _draft(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each sequence's drafts, as many as its placeholders: the draft model's greedy tokens after its
        last token, then after each draft. One read from the device, at the end."""
        wanted = [len(seq.drafts) for seq in seqs]
        lengths = [seq.num_tokens for seq in seqs]  # (none pending: can_speculate)
        # Each pass's drafts (a tensor on the device) and the sequences they are of, by their index in `seqs`.
        passes = [(self._catch_up(seqs), list(range(len(seqs))))]
        for depth in range(1, max(wanted)):
            before, rows = passes[-1]
            kept = [k for k, r in enumerate(rows) if wanted[r] > depth]
            rows = [rows[k] for k in kept]
            # Each computes its latest draft (at position length + depth - 1), read from the pass before.
            views = [_Row(seqs[r].block_table, lengths[r] + depth - 1) for r in rows]
            inputs = build_step_inputs(ScheduledBatch(views, [1] * len(views), len(views)), self.runner.block_size,
                                       list(range(len(views))), table_rows=self.tables)
            inputs.pending_at, inputs.pending_rows = np.arange(len(views)), np.asarray(kept, dtype=np.int64)
            passes.append((self._greedy(self.runner.run(inputs, before)), rows))
        drafts: list[list[int]] = [[] for _ in seqs]
        for tokens, rows in passes:
            for r, token in zip(rows, tokens.tolist()):
                drafts[r].append(token)
        for seq, length, proposed in zip(seqs, lengths, drafts):
            seq.draft_model_kv = (length, proposed[:-1])  # (the last draft is proposed, not computed)
        return drafts

    def _catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run each sequence's tokens that the draft model's KV does not hold yet, up to its last; return
        the first draft of each (a tensor on the device). Passes of at most max_num_batched_tokens tokens,
        a sequence's one-token catch-ups (the usual: its token after the drafts it kept) leading them."""
        todo = sorted(((self._held(seq), seq) for seq in seqs), key=lambda item: item[1].num_tokens - item[0] != 1)
        order = {id(seq): r for r, seq in enumerate(seqs)}
        budget = self.runner.config.max_num_batched_tokens
        firsts, finished = [], []
        while todo:
            views, counts, ends, left = [], [], [], budget
            while todo and left:
                start, seq = todo[0]
                n = min(seq.num_tokens - start, left)
                views.append(_Row(seq.block_table, start, seq.token_array))
                counts.append(n)
                left -= n
                if start + n == seq.num_tokens:
                    ends.append(sum(counts) - 1)
                    finished.append(order[id(seq)])
                    todo.pop(0)
                else:
                    todo[0] = (start + n, seq)
            inputs = build_step_inputs(ScheduledBatch(views, counts, len(views)), self.runner.block_size, ends,
                                       table_rows=self.tables)
            firsts.append(self._greedy(self.runner.run(inputs)))
        tokens = torch.cat(firsts)
        return tokens[torch.as_tensor(np.argsort(finished), device=tokens.device)]

    def _held(self, seq: Sequence) -> int:
        """How many of the sequence's first tokens the draft model's KV holds, one short of all at most (its
        last is computed again for the logits that propose): what it computed, and of the drafts it
        computed after them, those that became the sequence's tokens."""
        if seq.draft_model_kv is None:
            return 0
        computed, drafts = seq.draft_model_kv
        tokens = seq.token_array[computed:computed + len(drafts)]
        same = np.asarray(drafts[:len(tokens)]) == tokens
        held = computed + (int(np.argmin(same)) if not same.all() else len(same))
        return min(held, seq.num_tokens - 1)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, :self.vocab].argmax(dim=-1)


@dataclasses.dataclass
class _Row:
    """A sequence as one pass of the draft model computes it (the fields build_step_inputs reads): from
    `num_computed_tokens` on, its `tokens` (a draft read from the pass before: a placeholder here)."""

    block_table: BlockTable
    num_computed_tokens: int
    tokens: np.ndarray | None = None
    lora_id: int = 0
    prompt_embeds: None = None

    def token_at(self, index: int) -> int:
        return 0 if self.tokens is None or index >= len(self.tokens) else int(self.tokens[index])

    def token_slice(self, start: int, end: int) -> np.ndarray:
        return self.tokens[start:end]


def _check_tokenizer(tokenizer, draft: str, trust_remote_code: bool) -> None:
    """A draft model whose tokenizer differs from the model's would draft other tokens than it means: refused
    (a draft folder without a tokenizer is taken as the model's)."""
    try:
        theirs = AutoTokenizer.from_pretrained(draft, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        logger.info("draft model %s has no tokenizer of its own: taken to share the model's", draft)
        return
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"speculative_config's draft model {draft} has a tokenizer other than the model's: its "
                         "token ids would mean other text; a draft model must share the model's vocabulary")
