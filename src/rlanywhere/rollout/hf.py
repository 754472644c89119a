"""HFEngine: rollouts through transformers' `model.generate` (the reference engine; any causal LM, peft too).

Prompts are left-padded with an attention mask and repeated `n` times (row i*n+j = sample j of prompt i); a
request larger than `rows_per_wave` runs as one `generate` per chunk of prompts (base.prompt_chunks).
Sampling uses transformers' own temperature / top-k / top-p warpers, passed as explicit logits processors
followed by a recorder that keeps the log-softmax of the processed scores, so the returned log-probs are those
of the distribution each token was drawn from without storing `output_scores` for every step (which would be
steps x rows x vocab floats). The model's own generation_config (hub defaults such as top_k=20 or a repetition
penalty) is swapped out for the call, so only the given SamplingParams apply.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria
from transformers import StoppingCriteriaList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..lora import unwrap_peft
from .base import (
    GeneratorSource,
    RolloutBatch,
    RowStreams,
    RolloutEngine,
    SamplingParams,
    StopStringMatcher,
    build_rollout_batch,
    chunk_generator,
    collect_eos_ids,
    eos_lengths,
    keyed_exponential,
    left_pad,
    prompt_chunks,
    resolve_pad_token_id,
    validate_prompts,
)


class _SampledLogprobRecorder(LogitsProcessor):
    """Last logits processor: remembers log_softmax(scores) of the previous step, and at each call gathers the
    log-prob of the token that was sampled from it (the newest column of input_ids)."""

    def __init__(self) -> None:
        self.logprobs: list[torch.Tensor] = []
        self._previous: torch.Tensor | None = None

    def _collect(self, tokens: torch.Tensor) -> None:
        if self._previous is not None:
            self.logprobs.append(self._previous.gather(-1, tokens[:, None].long()).squeeze(-1))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._collect(input_ids[:, -1])
        self._previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        self._collect(last_tokens)
        self._previous = None
        return torch.stack(self.logprobs, dim=1)


class _KeyedSampler(LogitsProcessor):
    """After the recorder: draws each row's token from its own stream (`keyed_exponential`: the row's key and
    response position) and leaves only that token finite, so generate's greedy step picks it."""

    def __init__(self, row_keys: torch.Tensor, prompt_width: int):
        self.row_keys, self.prompt_width = row_keys, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(scores.float(), dim=-1)
        noise = keyed_exponential(self.row_keys.to(scores.device), input_ids.shape[1] - self.prompt_width,
                                  scores.shape[-1])
        if noise.device.type != "cuda":
            noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        tokens = (probs / noise).argmax(dim=-1, keepdim=True)
        return torch.full_like(scores, float("-inf")).scatter(-1, tokens, 0.0)


class _StopStringCriteria(StoppingCriteria):
    """Stops a row when its decoded response ends with a stop string; records the response length at that point."""

    def __init__(self, matcher: StopStringMatcher, prompt_width: int, eos_ids: list[int]):
        self.matcher = matcher
        self.prompt_width = prompt_width
        self.eos_ids = set(eos_ids)
        self.stop_lengths: dict[int, int] = {}
        self._ended_by_eos: set[int] = set()

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        responses = input_ids[:, self.prompt_width :].tolist()
        for row, response in enumerate(responses):
            if row in self.stop_lengths or row in self._ended_by_eos:
                continue
            if response and response[-1] in self.eos_ids:
                self._ended_by_eos.add(row)
            elif self.matcher.ends_with_stop(response):
                self.stop_lengths[row] = len(response)
        done = [row in self.stop_lengths for row in range(len(responses))]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _eager_layers():
    """Eager decoder layers even where the training passes compiled them (plan.compile_training): generate's KV cache
    and one-token steps would recompile them at every new length (torch >= 2.6; older torch has no stance)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _generation_context(hf_model: Any, module: torch.nn.Module, seed: int | None, device: torch.device):
    """Eval mode, no grad, a clean generation_config and (when seeded) a forked RNG, all restored afterwards."""
    was_training = module.training
    saved_config = getattr(hf_model, "generation_config", None)
    devices = [device] if device.type == "cuda" else []
    rng = torch.random.fork_rng(devices=devices) if seed is not None else contextlib.nullcontext()
    try:
        module.eval()
        hf_model.generation_config = GenerationConfig()
        with rng, torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            yield
    finally:
        hf_model.generation_config = saved_config
        module.train(was_training)


class HFEngine(RolloutEngine):
    """Rollouts with `model.generate`. Works for any transformers causal LM and for peft-wrapped models."""

    def __init__(self, model: Any, tokenizer: Any, pad_token_id: int | None = None, rows_per_wave: int | None = None):
        """rows_per_wave: the default of `generate`'s (the plan's `rollout.rows_per_wave`; None: all at once)."""
        prompt_chunks(1, 1, rows_per_wave)  # checks it
        self.rows_per_wave = rows_per_wave
        self.model = model
        self.tokenizer = tokenizer
        self.hf_model = unwrap_peft(model)
        self.eos_ids = collect_eos_ids(tokenizer, self.hf_model)
        self.pad_token_id = resolve_pad_token_id(pad_token_id, tokenizer, self.eos_ids)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: GeneratorSource = None,
        rows_per_wave: int | None = None,
    ) -> RolloutBatch:
        vocab = getattr(self.hf_model.config.get_text_config(), "vocab_size", None)
        prompts = validate_prompts(prompts, vocab)
        matcher = StopStringMatcher(self.tokenizer, params.stop_strings)
        parts = []
        rows_per_wave = rows_per_wave if rows_per_wave is not None else self.rows_per_wave
        chunks = prompt_chunks(len(prompts), params.n, rows_per_wave)
        if generator is None and params.seed is not None and len(chunks) > 1:
            generator = torch.Generator().manual_seed(params.seed)  # one stream: waves draw different seeds
        for chunk in chunks:
            # Seed transformers' sampling (global RNG, forked) from the chunk's generator, else from params.seed;
            # RowStreams: each row samples from its own stream (_KeyedSampler).
            gen = chunk_generator(generator, chunk.start)
            seed = params.seed
            if gen is not None:
                seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device).item())
            keys = (generator.offset(chunk.start).keys(len(chunk), params.n)[:-1]
                    if isinstance(generator, RowStreams) and not params.greedy else None)
            parts.append(self._generate_wave([prompts[i] for i in chunk], params, seed, matcher, keys))
        return RolloutBatch.concat(parts, self.pad_token_id)

    def _generate_wave(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
                       matcher: StopStringMatcher, row_keys: torch.Tensor | None = None) -> RolloutBatch:
        device = self.device
        eos_ids = [] if params.ignore_eos else list(self.eos_ids)

        repeated = [p for p in prompts for _ in range(params.n)]
        input_ids, attention_mask = left_pad(repeated, self.pad_token_id, device)
        prompt_width = input_ids.shape[1]

        processors = LogitsProcessorList()
        if not params.greedy:
            if params.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                processors.append(TopKLogitsWarper(top_k=params.top_k))
            if params.top_p < 1.0:
                processors.append(TopPLogitsWarper(top_p=params.top_p))
        recorder = _SampledLogprobRecorder()
        processors.append(recorder)
        if row_keys is not None:
            processors.append(_KeyedSampler(row_keys, prompt_width))
        criteria = StoppingCriteriaList()
        stop_criteria = None
        if matcher:
            stop_criteria = _StopStringCriteria(matcher, prompt_width, eos_ids)
            criteria.append(stop_criteria)

        # Temperature / top-k / top-p are applied by our own warpers above (so they run before the recorder);
        # the config's own are set to "off", since unset values would take transformers' defaults (top_k=50).
        sampling_off = ({} if params.greedy or row_keys is not None else
                        {"temperature": 1.0, "top_k": 0, "top_p": 1.0})
        generation_config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy and row_keys is None,
            **sampling_off,
            num_beams=1,
            num_return_sequences=1,
            eos_token_id=eos_ids or None,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            use_cache=True,
        )
        with _generation_context(self.hf_model, self.model, seed, device), _eager_layers():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=generation_config,
                logits_processor=processors,
                stopping_criteria=criteria,
            )
        tokens = out.sequences[:, prompt_width:]
        logprobs = recorder.finish(tokens[:, -1])
        lengths = eos_lengths(tokens, eos_ids)
        if stop_criteria is not None:
            for row, length in stop_criteria.stop_lengths.items():
                lengths[row] = min(int(lengths[row]), length)
        return build_rollout_batch(prompts, params.n, tokens, logprobs, lengths, self.pad_token_id)


__all__ = ["HFEngine"]
