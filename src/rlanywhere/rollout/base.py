"""Rollout interface shared by every engine: sampling parameters, the RolloutBatch contract and helpers.

A rollout engine turns unpadded prompts (lists of token ids) into a `RolloutBatch`: for `B` prompts and `n`
samples each, row `i*n + j` is sample `j` of prompt `i`. Prompts are left-padded, responses right-padded, and
`response_logprobs` holds the log-probability of each sampled token under the distribution it was drawn from
(after temperature / top-k / top-p; for greedy decoding, the temperature-1 log-softmax of the raw logits).

This module also holds the pieces both engines share so they agree exactly: the processed-logits functions
(temperature, top-k, top-p with the same semantics as transformers' warpers), EOS id collection, stop-string
matching, and the assembly of a `RolloutBatch` from generated tokens.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence, Union

import torch
import torch.nn.functional as F

from ..logprobs import default_position_ids
from ..vocabulary import FP32

NEG_INF = float("-inf")


@dataclass
class SamplingParams:
    """How to sample. `temperature == 0` means greedy; `top_k == 0` and `top_p == 1` switch those filters off.

    `stop_strings`: a sequence stops once its decoded response ends with one of them (the stop string stays in
    the response). `ignore_eos`: keep generating past EOS (benchmarks with fixed response lengths).
    `seed`: used when `generate` gets no generator, so a call is reproducible on its own.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop_strings: Sequence[str] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop_strings, str):
            # A bare string would otherwise be read as a list of one-character stop strings.
            self.stop_strings = (self.stop_strings,)
        self.stop_strings = tuple(self.stop_strings)
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n (samples per prompt) must be an int >= 1, got {self.n!r}")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop_strings must hold non-empty strings, got {s!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RolloutBatch:
    """Generated rollouts; see the module docstring and docs/ARCHITECTURE.md for the layout."""

    prompt_ids: torch.Tensor  # [B*n, P] long, left-padded
    prompt_mask: torch.Tensor  # [B*n, P] long, 1 = real token
    response_ids: torch.Tensor  # [B*n, R] long, right-padded
    response_mask: torch.Tensor  # [B*n, R] long, 1 = generated token (EOS included)
    response_logprobs: torch.Tensor  # [B*n, R] float32, 0 at padding
    num_prompts: int
    n: int

    def to(self, device: torch.device | str) -> "RolloutBatch":
        return RolloutBatch(
            prompt_ids=self.prompt_ids.to(device),
            prompt_mask=self.prompt_mask.to(device),
            response_ids=self.response_ids.to(device),
            response_mask=self.response_mask.to(device),
            response_logprobs=self.response_logprobs.to(device),
            num_prompts=self.num_prompts,
            n=self.n,
        )

    def decode(self, tokenizer: Any) -> list[str]:
        """Response texts, special tokens (EOS) and padding dropped: what a reward function reads."""
        ids = self.response_ids.masked_fill(self.response_mask == 0, tokenizer.pad_token_id)
        return tokenizer.batch_decode(ids, skip_special_tokens=True)

    def response_lengths(self) -> torch.Tensor:
        """Response tokens per row, [B*n] long: through its last generated token, so a multi-turn row's tool-result
        tokens count as they count against the response length (verl's lengths, from the attention mask)."""
        return response_extents(self.response_mask)

    def narrowed(self) -> RolloutBatch:
        """As wide as its rows need, as a rollout of just these rows would be (rows picked out of a wider batch):
        the prompt columns that are padding in every row dropped on the left, the response ones on the right."""
        prompt, response = _used_columns(self.prompt_mask, from_left=True), _used_columns(self.response_mask)
        return RolloutBatch(prompt_ids=self.prompt_ids[:, -prompt:], prompt_mask=self.prompt_mask[:, -prompt:],
                            response_ids=self.response_ids[:, :response],
                            response_mask=self.response_mask[:, :response],
                            response_logprobs=self.response_logprobs[:, :response], num_prompts=self.num_prompts,
                            n=self.n)

    @staticmethod
    def concat(parts: Sequence["RolloutBatch"], pad_token_id: int) -> "RolloutBatch":
        """Stack rollouts of several calls or waves (same n): prompts stay left-padded, responses right-padded,
        both to the widest part."""
        if not parts:
            raise ValueError("RolloutBatch.concat needs at least one part")
        if len({p.n for p in parts}) != 1:
            raise ValueError(f"RolloutBatch.concat: parts have different n {sorted({p.n for p in parts})}")
        if len(parts) == 1:
            return parts[0]
        width_p = max(p.prompt_ids.shape[1] for p in parts)
        width_r = max(p.response_ids.shape[1] for p in parts)

        def left(t: torch.Tensor, value: float) -> torch.Tensor:
            return F.pad(t, (width_p - t.shape[1], 0), value=value)

        def right(t: torch.Tensor, value: float) -> torch.Tensor:
            return F.pad(t, (0, width_r - t.shape[1]), value=value)

        return RolloutBatch(
            prompt_ids=torch.cat([left(p.prompt_ids, pad_token_id) for p in parts]),
            prompt_mask=torch.cat([left(p.prompt_mask, 0) for p in parts]),
            response_ids=torch.cat([right(p.response_ids, pad_token_id) for p in parts]),
            response_mask=torch.cat([right(p.response_mask, 0) for p in parts]),
            response_logprobs=torch.cat([right(p.response_logprobs, 0.0) for p in parts]),
            num_prompts=sum(p.num_prompts for p in parts),
            n=parts[0].n,
        )

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, position_ids) of prompt+response, as the training forward passes want."""
        input_ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        attention_mask = torch.cat([self.prompt_mask, self.response_mask], dim=1)
        position_ids = default_position_ids(attention_mask)
        return input_ids, attention_mask, position_ids


def response_extents(response_mask: torch.Tensor) -> torch.Tensor:
    """[rows] long: the position after each row's last token of mask 1 (0 for an empty row); the number of 1s where
    the mask has no holes (single-turn), more where a multi-turn row's tool tokens (mask 0) sit in between."""
    positions = torch.arange(1, response_mask.shape[-1] + 1, device=response_mask.device)
    return (positions * (response_mask > 0)).amax(-1) if response_mask.shape[-1] else response_mask.sum(-1).long()


_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(value: int) -> int:
    """A 64-bit integer hash (SplitMix64's finaliser), in Python integers: the same on every machine."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class RowStreams:
    """One random stream per response row, keyed by (seed, global prompt index, sample index): a row draws the same
    noise at each response position whatever wave, rank or batch it is generated in, so the samples of a step do
    not depend on how the rollout is split (world size, rollout batch size, an OOM halving). `seed` already holds
    the run's seed and step (the trainer's `RolloutPhase.row_streams`); `first_prompt` is the global index of the
    request's prompt 0."""

    seed: int
    first_prompt: int = 0

    def offset(self, prompts: int) -> "RowStreams":
        """The streams of a request that starts `prompts` prompts later."""
        return replace(self, first_prompt=self.first_prompt + prompts)

    def row_key(self, prompt: int, sample: int) -> int:
        """The 64-bit key of sample `sample` of the request's prompt `prompt`."""
        return _splitmix64(_splitmix64(_splitmix64(self.seed) ^ (self.first_prompt + prompt)) ^ sample)

    def keys(self, num_prompts: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 [num_prompts * n + 1]: the key of each request row (row p * n + j is sample j of prompt p), and a
        last one for the scratch row that filler rows of a batch bucket write to."""
        return _key_tensor([self.row_key(p, j) for p in range(num_prompts) for j in range(n)], device)


@dataclass(frozen=True)
class TurnStreams(RowStreams):
    """The streams of a later turn of multi-turn rows that are generated again as new prompts (one sample each:
    the conversation so far is the prompt). Request prompt i is row `rows[first_prompt + i]` of the rollout,
    counted as `RowStreams(seed)` counts rows (sample `row % n` of global prompt `row // n`); its stream for turn
    `turn` is keyed by (that row's key, turn). A row therefore draws the same in any request, wave or rank, and
    each turn draws afresh (its response positions start at 0 again)."""

    rows: tuple[int, ...] = ()
    n: int = 1
    turn: int = 1

    def keys(self, num_prompts: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        if n != 1 or self.first_prompt + num_prompts > len(self.rows):
            raise ValueError(f"TurnStreams covers {len(self.rows)} rows of one sample each; asked for prompts "
                             f"{self.first_prompt}..{self.first_prompt + num_prompts - 1} x {n} samples")
        origin = RowStreams(self.seed)
        picked = self.rows[self.first_prompt:self.first_prompt + num_prompts]
        return _key_tensor([_splitmix64(origin.row_key(row // self.n, row % self.n) ^ _splitmix64(self.turn))
                            for row in picked], device)


def _key_tensor(keys: list[int], device: torch.device | str) -> torch.Tensor:
    """Unsigned 64-bit keys as int64 [len + 1], the last 0 (the scratch row's)."""
    keys = keys + [0]
    return torch.tensor([k - (1 << 64) if k >= (1 << 63) else k for k in keys], dtype=torch.long, device=device)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in [0, 2**32): wrapping products kept to
    32 bits, so the result is the same on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def keyed_exponential(keys: torch.Tensor, position: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] fp32 for response position `position`: entry (r, v) is a function of (keys[r],
    position, v) only, so a row draws the same noise in any batch."""
    low, high = (keys & _MASK32)[:, None], ((keys >> 32) & _MASK32)[:, None]
    at_position = _mix32(low ^ (_splitmix64(position) & _MASK32))  # the row's stream at this position
    token = torch.arange(vocab, device=keys.device, dtype=torch.long)[None, :]
    bits = _mix32((_mix32(token ^ at_position) + high) & _MASK32)
    uniform = ((bits >> 8).to(FP32) + 0.5) * (1.0 / (1 << 24))  # 24 bits, in (0, 1): never 0
    return -torch.log(uniform)


# A torch.Generator (one random stream through the whole request), a function of the index of a wave's first
# prompt returning one (a fresh stream per wave), or RowStreams (one stream per row, keyed by its global prompt
# and sample index: the trainer's, so that the samples do not depend on how the rollout is split).
GeneratorSource = Union[torch.Generator, Callable[[int], torch.Generator], RowStreams, None]


class RolloutEngine(abc.ABC):
    """Generates responses for a batch of prompts. Subclasses: HFEngine (any model), FastEngine (Llama family)."""

    @abc.abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: GeneratorSource = None,
        rows_per_wave: int | None = None,
    ) -> RolloutBatch:
        """Sample `params.n` responses for each unpadded prompt; row i*n+j is sample j of prompt i.

        rows_per_wave: sequences generated together (default: the engine's plan; None there: all at once). A
        larger request runs in waves of `rows_per_wave // n` prompts (see `prompt_chunks`); the result is what
        one call per chunk with `generator` (or `generator(first prompt of the chunk)`) would give, stacked.
        """

    def sync_weights(self) -> None:
        """Called by the trainer after each actor update. Engines that read the live weights may do nothing."""

    def release_memory(self) -> None:
        """Free memory the engine holds between calls (KV cache, graphs); the next generate re-allocates it."""


# ----------------------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------------------


def validate_prompts(prompts: Any, vocab_size: int | None = None) -> list[list[int]]:
    """Check that prompts are a non-empty list of non-empty lists of token ids; return them as lists of ints."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError(
            "prompts must be a non-empty list of unpadded token-id lists (list[list[int]]); "
            f"got {type(prompts).__name__}. Strip padding and pass one list per prompt."
        )
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if not isinstance(p, (list, tuple)) or len(p) == 0:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {p!r}")
        ids = [int(t) for t in p]
        if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
            raise ValueError(
                f"prompt {i} has token ids outside [0, {vocab_size}); was it tokenized with this model's tokenizer?"
            )
        out.append(ids)
    return out


def collect_eos_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """EOS ids that end a response: the tokenizer's eos_token_id plus the model's generation_config eos ids."""
    ids: list[int] = []

    def add(value: Any) -> None:
        if value is None:
            return
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if isinstance(value, (list, tuple)):
            for v in value:
                add(v)
        elif int(value) not in ids:
            ids.append(int(value))

    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    gen_cfg = getattr(model, "generation_config", None) if model is not None else None
    if gen_cfg is not None:
        add(getattr(gen_cfg, "eos_token_id", None))
    return ids


def resolve_pad_token_id(pad_token_id: int | None, tokenizer: Any, eos_ids: Sequence[int]) -> int:
    """The explicit pad id, else the tokenizer's, else the first EOS id, else 0."""
    if pad_token_id is not None:
        return int(pad_token_id)
    tok_pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if tok_pad is not None:
        return int(tok_pad)
    if eos_ids:
        return int(eos_ids[0])
    return 0


def resolve_generator(
    generator: torch.Generator | None, seed: int | None, device: torch.device
) -> torch.Generator:
    """A generator on `device`: the given one if it lives there, else one seeded from it / from `seed` / globally.

    Seeding from the caller's generator (instead of rejecting a CPU generator for a CUDA engine) keeps calls
    reproducible and advances the caller's generator, so two calls in a row draw different samples.
    """
    device = torch.device(device)
    if generator is not None and torch.device(generator.device).type == device.type:
        return generator
    if generator is not None:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    elif seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    out = torch.Generator(device=device)
    out.manual_seed(seed)
    return out


def prompt_chunks(num_prompts: int, n: int, rows_per_wave: int | None) -> list[range]:
    """Consecutive prompt ranges of max(1, rows_per_wave // n) prompts each (one range when rows_per_wave is None):
    the waves of a request, as the trainer chunked its engine calls."""
    if rows_per_wave is not None and (isinstance(rows_per_wave, bool) or not isinstance(rows_per_wave, int)
                                      or rows_per_wave < 1):
        raise ValueError(f"rows_per_wave must be an int >= 1 or None (all at once), got {rows_per_wave!r}")
    per_chunk = num_prompts if rows_per_wave is None else max(1, rows_per_wave // n)
    return [range(i, min(i + per_chunk, num_prompts)) for i in range(0, num_prompts, per_chunk)]


def chunk_generator(generator: GeneratorSource, first_prompt: int) -> torch.Generator | None:
    """The generator a chunk starting at prompt `first_prompt` draws from (see GeneratorSource; RowStreams: none,
    the rows draw from their own streams)."""
    if isinstance(generator, RowStreams):
        return None
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    if callable(generator):
        return generator(first_prompt)
    raise TypeError(f"generator must be a torch.Generator, a function of the first prompt index, or None; "
                    f"got {type(generator).__name__}")


def apply_temperature_top_k_top_p(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Processed scores of the sampling distribution, [N, V] float: logits/T, then top-k, then top-p filtering.

    Same semantics as transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper with
    min_tokens_to_keep=1 (ties at the k-th value are kept; top-p keeps the smallest set whose mass >= p).
    """
    scores = logits / temperature if temperature != 1.0 else logits
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, NEG_INF)
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1.0 - top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, NEG_INF)
    return scores


def sample_from_logits(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    row_keys: torch.Tensor | None = None, position: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of float logits [N, V]; return (tokens [N] long, log-probs [N] float32).

    Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)), which draws exactly from the softmax
    distribution and needs no host synchronisation. row_keys (int64 [N], `RowStreams.keys`): each row's noise
    comes from its own stream at response position `position` (`keyed_exponential`), not from `generator`.
    """
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return tokens, chosen - torch.logsumexp(logits, dim=-1)
    scores = apply_temperature_top_k_top_p(logits, params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scores, dim=-1)
    if row_keys is not None:
        noise = keyed_exponential(row_keys.to(probs.device), position, probs.shape[-1])
    else:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    if noise.device.type != "cuda":
        # The CPU sampler can draw exactly 0 (CUDA's never does); p/0 would win the race regardless of p.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    tokens = (probs / noise).argmax(dim=-1)  # exponential race: P(i) = p_i (fewer passes than Gumbel + logsumexp)
    return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()


class StopStringMatcher:
    """Decides whether a response's last token completed one of the stop strings: an occurrence of it that ends
    within the text that token added, also where the token runs on past it (`>\n` after `</answer`: a BPE vocabulary
    merges a stop string's last characters with what follows), as transformers' StopStringCriteria and vLLM do.
    The token stays in the response.

    Decodes only a tail of the response (enough tokens to cover the longest stop string), falling back to the
    whole response when the tail decodes to too few characters.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str]):
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer to decode responses; pass the tokenizer to the engine")
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.max_chars = max((len(s) for s in self.stop_strings), default=0)
        self.tail_tokens = self.max_chars + 8

    def __bool__(self) -> bool:
        return bool(self.stop_strings)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def ends_with_stop(self, ids: Sequence[int]) -> bool:
        """Whether the last token of `ids` completed a stop string."""
        tail = list(ids[-self.tail_tokens:])
        text = self._decode(tail)
        if len(text) < self.max_chars and len(ids) > self.tail_tokens:
            tail = list(ids)
            text = self._decode(tail)
        before = len(self._decode(tail[:-1])) if len(tail) > 1 else 0  # the characters earlier tokens wrote
        # an occurrence ending after `before` characters ends in the last token's text
        return any(text.find(stop, max(0, before - len(stop) + 1)) != -1 for stop in self.stop_strings)

    def first_stop_length(self, ids: Sequence[int], start: int = 0) -> int | None:
        """Smallest length L > start such that ids[:L] ends with a stop string, or None."""
        for length in range(max(start, 0) + 1, len(ids) + 1):
            if self.ends_with_stop(ids[:length]):
                return length
        return None


def left_pad(prompts: list[list[int]], pad_token_id: int, device: torch.device | str = "cpu"):
    """Left-pad prompts into (ids [B, P] long, mask [B, P] long)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def eos_lengths(tokens: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """Per-row response length when stopping at (and including) the first EOS; full width if none. [N] long."""
    n_rows, width = tokens.shape
    full = torch.full((n_rows,), width, dtype=torch.long, device=tokens.device)
    if not eos_ids or width == 0:
        return full
    is_eos = torch.isin(tokens, torch.tensor(list(eos_ids), dtype=tokens.dtype, device=tokens.device))
    first = is_eos.to(torch.int8).argmax(dim=-1)
    return torch.where(is_eos.any(dim=-1), first + 1, full)


def build_rollout_batch(
    prompts: list[list[int]],
    n: int,
    response_tokens: torch.Tensor,
    response_logprobs: torch.Tensor,
    lengths: torch.Tensor,
    pad_token_id: int,
) -> RolloutBatch:
    """Assemble a RolloutBatch from raw generated tokens [B*n, T] and their lengths [B*n] (on one device)."""
    device = response_tokens.device
    lengths = lengths.to(device=device, dtype=torch.long).clamp(max=response_tokens.shape[1])
    width = int(lengths.max().item()) if lengths.numel() else 0
    tokens = response_tokens[:, :width]
    mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
    response_ids = torch.where(mask.bool(), tokens, torch.full_like(tokens, pad_token_id))
    logprobs = torch.where(mask.bool(), response_logprobs[:, :width].float(), torch.zeros((), device=device))
    repeated = [p for p in prompts for _ in range(n)]
    prompt_ids, prompt_mask = left_pad(repeated, pad_token_id, device)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=mask,
        response_logprobs=logprobs,
        num_prompts=len(prompts),
        n=n,
    )


__all__ = [
    "SamplingParams",
    "RolloutBatch",
    "RolloutEngine",
    "GeneratorSource",
    "RowStreams",
    "TurnStreams",
    "response_extents",
    "keyed_exponential",
    "prompt_chunks",
    "chunk_generator",
    "apply_temperature_top_k_top_p",
    "sample_from_logits",
    "StopStringMatcher",
    "collect_eos_ids",
    "resolve_pad_token_id",
    "resolve_generator",
    "build_rollout_batch",
    "eos_lengths",
    "left_pad",
    "validate_prompts",
]


def _used_columns(mask: torch.Tensor, from_left: bool = False) -> int:
    """How many columns hold a real token in some row (counted from the right for left-padded prompts); at least 1."""
    used = mask.bool().any(0).nonzero().flatten()
    if used.numel() == 0:
        return 1
    return int(mask.shape[1] - used[0]) if from_left else int(used[-1]) + 1
