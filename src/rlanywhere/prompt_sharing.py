"""Shared prompts in the training passes: a GRPO group's prompt runs through the model once, not once per sample.

The n samples of a prompt (GRPO, RLOO, DAPO groups) share its tokens, and causal attention makes the prompt's hidden
states independent of what follows. With packed rows (microbatch.pack_rows) every row repeats the prompt: for 8
samples of a 120-token prompt with 256-token responses, 28 % of the tokens a micro-batch pushes through every layer,
forward and backward, are repeats. Here a micro-batch becomes one token stream, each distinct prompt once and then
the responses of its rows, with no padding between rows:

    stream   [prompt A | A's response 1 | A's response 2 | ... | prompt B | B's response 1 | ... | tail padding]
    position  0 .. P_A-1  P_A .. P_A+R_1-1  P_A .. P_A+R_2-1       0 .. P_B-1  ...

Norms, projections, MLPs and the log-prob head see only real tokens. Attention is the one place tokens meet, and
it runs as a batch of *sequences*, each a chunk of queries with the keys it may see:
- a chunk of a prompt's tokens sees that prompt up to itself;
- a response's tokens see their prompt and their own response up to themselves (never a sibling response);
so every token's attention is what it would be in its own packed row. The sequences are gathered from the stream
and the outputs gathered back, both differentiable, so the gradient is the same sum over each row's tokens (the
prompt's tokens collect the gradient of all its samples). Two kernels run them: MASKED, a [sequences, heads, slots,
D] batch for SDPA with a boolean mask (any dtype, any backend), and VARLEN, PyTorch's varlen flash attention, where
each sequence's queries are the last tokens of its keys: causal from the bottom right, no mask, no padded slots
(flash takes no mask, so this is the kernel that keeps up where packed rows run flash). Values equal the packed-row
passes' up to float summation order (tests/test_prompt_sharing.py).

Pieces: `pack_shared_prompts` (host: the stream, positions, label indices, the attention layout),
`SharedPromptBatch.to` (device; the mask built there) and `.decoder_kwargs`, `shared_prompt_attention` (the attention function, registered
with transformers by models.hf_attention_implementation; calls without a layout fall through to the planned SDPA),
and `split_rows_keeping_prompts` (micro-batches that keep a prompt's rows together). The planner decides where it
runs and with which kernel (plan.share_prompts, plan.shared_prompt_kernel).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch import nn

from . import machine
from .estimator import PROMPT_CHUNK_MIN
from .microbatch import response_lengths, round_up
from .vocabulary import SHARED_PROMPTS_MASKED, SHARED_PROMPTS_VARLEN

# kwarg name the decoder passes through its layers to the attention function (transformers forwards **kwargs)
LAYOUT_KWARG = "shared_prompt_layout"


MASKED = SHARED_PROMPTS_MASKED  # SDPA over [sequences, heads, slots, D] with a boolean mask: any backend and dtype
VARLEN = SHARED_PROMPTS_VARLEN  # flash over variable-length sequences, causal from the bottom right: no mask
KERNELS = (MASKED, VARLEN)


class SharedPromptLayout(NamedTuple):
    """How the tokens of one shared-prompt micro-batch attend: S sequences gathered from the N-token stream, each a
    run of queries that are the last tokens of its keys (key j of a sequence is at position j).

    MASKED (padded slots point at token 0): query_index [S, Lq], key_index [S, Lk], slot_of_token [N] (each stream
    token's slot s * Lq + i), query_positions [S, Lq] (-1 at empty slots), key_counts [S], and the mask [S, 1, Lq, Lk]
    (True = may attend, built on the device). VARLEN: query_order [N] (the stream's tokens sequence by sequence),
    token_order [N] (its inverse), key_gather [Tk] (every sequence's keys, one after the other), cu_queries and
    cu_keys [S + 1] (int32 offsets), and the longest query and key runs."""

    kernel: str
    query_positions: Optional[torch.Tensor] = None
    query_index: Optional[torch.Tensor] = None
    key_index: Optional[torch.Tensor] = None
    slot_of_token: Optional[torch.Tensor] = None
    key_counts: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    query_order: Optional[torch.Tensor] = None
    token_order: Optional[torch.Tensor] = None
    key_gather: Optional[torch.Tensor] = None
    cu_queries: Optional[torch.Tensor] = None
    cu_keys: Optional[torch.Tensor] = None
    max_queries: int = 0
    max_keys: int = 0


class SharedPromptBatch(NamedTuple):
    """Inputs of one shared-prompt micro-batch: the stream [1, N], its positions, and where each row's response
    tokens (labels) and the states that predict them (before) sit in it, [b, R'] (clamped past a row's response,
    masked by the caller); ``response_len`` is R', the longest response kept. Host tensors until ``to``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    response_len: int
    label_index: torch.Tensor
    before_index: torch.Tensor
    layout: SharedPromptLayout

    def to(self, device, non_blocking: bool = True) -> "SharedPromptBatch":
        """On `device`; a MASKED layout gets its attention mask built there from the small per-slot tensors."""
        move = lambda t: t.to(device, non_blocking=non_blocking) if torch.is_tensor(t) else t  # noqa: E731
        layout = SharedPromptLayout(*(move(t) for t in self.layout))
        if layout.kernel == MASKED:
            keys = torch.arange(layout.key_index.shape[1], device=layout.key_index.device)
            positions = layout.query_positions[..., None]
            # key j (position j of its sequence) is seen by a query at position p >= j; an empty query slot sees
            # key 0 only, so no softmax row is empty (an all-masked row gives NaN gradients in some SDPA kernels)
            mask = ((keys <= positions) & (keys < layout.key_counts[:, None, None])) | ((positions < 0) & (keys == 0))
            layout = layout._replace(mask=mask[:, None])
        return self._replace(input_ids=move(self.input_ids), position_ids=move(self.position_ids),
                             label_index=move(self.label_index), before_index=move(self.before_index), layout=layout)

    def decoder_kwargs(self) -> dict:
        """What a decoder call takes for this (device) stream besides its ids: a 4D attention mask, which
        transformers passes to the attention function as it is instead of building one (the layout's mask, or a
        placeholder for VARLEN), the stream's positions, and the layout for the attention."""
        mask = self.layout.mask
        if mask is None:
            mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.input_ids.device)
        return {"attention_mask": mask, "position_ids": self.position_ids, LAYOUT_KWARG: self.layout}


def prompt_keys(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: Sequence[int]) -> list[tuple[int, ...]]:
    """Each row's real prompt tokens (left padding dropped): rows with equal keys share their prompt."""
    ids, mask = prompt_ids[list(rows)].tolist(), prompt_mask[list(rows)].bool().tolist()
    return [tuple(t for t, real in zip(row_ids, row_mask) if real) for row_ids, row_mask in zip(ids, mask)]


def pack_shared_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                        response_mask: torch.Tensor, rows: Sequence[int], pad_token_id: int,
                        width_multiple: int = 1, kernel: str = MASKED) -> SharedPromptBatch:
    """The shared-prompt micro-batch of ``rows`` of a RolloutBatch (left-padded prompts, right-padded responses
    whose mask is a prefix), laid out for the attention `kernel` (MASKED or VARLEN). Distinct prompts keep their
    first row's order; the stream is padded at its end to a multiple of ``width_multiple`` (compiled passes), the
    padding a sequence of its own that nothing reads."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    rows = list(rows)
    if not rows:
        raise ValueError("rows is empty: a micro-batch needs at least one row")
    keys = prompt_keys(prompt_ids, prompt_mask, rows)
    if any(len(key) == 0 for key in keys):
        raise ValueError(f"rows {[r for r, k in zip(rows, keys) if not k]} have no prompt tokens; the first "
                         "response token needs at least one prompt token before it")
    response_lens = response_lengths(response_mask[rows])
    response_len = max(response_lens)
    # masked: a prompt's queries in chunks about as long as the longest response (fewer empty slots); varlen: whole
    chunk = max(response_len, PROMPT_CHUNK_MIN) if kernel == MASKED else None
    groups: dict[tuple[int, ...], list[int]] = {}  # prompt -> positions in `rows`
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)

    stream: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    sequences: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (query idx, query pos, key idx)
    label_index = torch.zeros(len(rows), response_len, dtype=torch.long)
    before_index = torch.zeros(len(rows), response_len, dtype=torch.long)
    start = 0
    for key, members in groups.items():
        prompt = torch.tensor(key, dtype=torch.long)
        p = len(key)
        prompt_at = torch.arange(start, start + p)
        stream.append(prompt)
        positions.append(torch.arange(p))
        start += p
        for lo in range(0, p, chunk or p):
            hi = min(lo + (chunk or p), p)
            sequences.append((prompt_at[lo:hi], torch.arange(lo, hi), prompt_at[:hi]))
        for i in members:
            r = response_lens[i]
            response_at = torch.arange(start, start + r)
            stream.append(response_ids[rows[i], :r])
            positions.append(torch.arange(p, p + r))
            start += r
            sequences.append((response_at, torch.arange(p, p + r), torch.cat([prompt_at, response_at])))
            label_index[i, :r] = response_at
            label_index[i, r:] = response_at[-1]
            before_index[i, 0] = prompt_at[-1]
            before_index[i, 1:] = label_index[i, :-1]
    padding = round_up(start, width_multiple) - start
    if padding:
        pad_at = torch.arange(start, start + padding)
        stream.append(torch.full((padding,), pad_token_id, dtype=torch.long))
        positions.append(torch.arange(padding))
        sequences.append((pad_at, torch.arange(padding), pad_at))

    if kernel == VARLEN:
        layout = _varlen_layout(sequences, start + padding)
    else:
        layout = _masked_layout(sequences, start + padding, width_multiple)
    return SharedPromptBatch(torch.cat(stream)[None], torch.cat(positions)[None], response_len, label_index,
                             before_index, layout)


def _varlen_layout(sequences, tokens: int) -> SharedPromptLayout:
    query_order = torch.cat([queries for queries, _, _ in sequences])
    token_order = torch.empty(tokens, dtype=torch.long)
    token_order[query_order] = torch.arange(tokens)
    query_counts = torch.tensor([len(queries) for queries, _, _ in sequences])
    key_counts = torch.tensor([len(keys_at) for _, _, keys_at in sequences])
    cumulative = lambda counts: torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int()])  # noqa: E731
    return SharedPromptLayout(
        VARLEN, query_order=query_order, token_order=token_order, key_gather=torch.cat([keys_at for _, _, keys_at in sequences]),
        cu_queries=cumulative(query_counts), cu_keys=cumulative(key_counts), max_queries=int(query_counts.max()),
        max_keys=int(key_counts.max()))


def _masked_layout(sequences, tokens: int, width_multiple: int) -> SharedPromptLayout:
    # slot counts rounded like the stream: compiled passes see widths of one residue (no recompile per width)
    n_queries = round_up(max(len(q) for q, _, _ in sequences), width_multiple)
    n_keys = round_up(max(len(k) for _, _, k in sequences), width_multiple)
    query_index = torch.zeros(len(sequences), n_queries, dtype=torch.long)
    query_positions = torch.full((len(sequences), n_queries), -1, dtype=torch.long)
    key_index = torch.zeros(len(sequences), n_keys, dtype=torch.long)
    key_counts = torch.zeros(len(sequences), dtype=torch.long)
    slot_of_token = torch.zeros(tokens, dtype=torch.long)
    for s, (queries, query_pos, keys_at) in enumerate(sequences):
        query_index[s, :len(queries)] = queries
        query_positions[s, :len(queries)] = query_pos
        key_index[s, :len(keys_at)] = keys_at
        key_counts[s] = len(keys_at)
        slot_of_token[queries] = s * n_queries + torch.arange(len(queries))
    return SharedPromptLayout(MASKED, query_positions, query_index=query_index, key_index=key_index,
                              slot_of_token=slot_of_token, key_counts=key_counts)


def split_rows_keeping_prompts(keys: Sequence[tuple[int, ...]], response_lens: Sequence[int], size: int,
                               by_tokens: bool = False, row_tokens: Optional[int] = None,
                               padded: bool = False) -> list[list[int]]:
    """Micro-batches of row positions with the rows of one prompt next to each other, so they share it: `size`
    rows each, or (by_tokens) as many rows as fit `size` stream tokens (a prompt counted once per micro-batch) and,
    when given, `row_tokens` key slots of the rows' own attention sequences (each row's prompt and response, which
    its attention gathers; `padded`: each as long as the longest, as the masked kernel lays them out). Indices
    inside a micro-batch are ascending; every row appears once."""
    if not (isinstance(size, int) and size > 0):
        raise ValueError(f"micro-batch size must be a positive int, got {size!r}")
    if row_tokens is not None and not by_tokens:
        raise ValueError("row_tokens bounds token-budget micro-batches: pass by_tokens=True")
    order: dict[tuple[int, ...], list[int]] = {}
    for i, key in enumerate(keys):
        order.setdefault(key, []).append(i)
    groups: list[list[int]] = []
    current: list[int] = []
    seen: set[tuple[int, ...]] = set()
    tokens = slots = longest = 0
    for key, members in order.items():
        for i in members:
            cost = response_lens[i] + (0 if key in seen else len(key))
            row = response_lens[i] + len(key)
            wider = max(longest, row)
            grown = (len(current) + 1) * wider if padded else slots + row
            full = (tokens + cost > size or (row_tokens is not None and grown > row_tokens)) if by_tokens \
                else len(current) == size
            if current and full:
                groups.append(sorted(current))
                current, seen, tokens = [], set(), 0
                cost = wider = grown = row  # the row opens a micro-batch of its own
            current.append(i)
            seen.add(key)
            tokens += cost
            slots, longest = grown, wider
    if current:
        groups.append(sorted(current))
    return groups


def shared_prompt_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                            scaling: Optional[float] = None, is_causal: Optional[bool] = None, *,
                            fallback: Callable, **kwargs):
    """transformers' attention-function signature; query [1, H, N, D], key/value [1, KV, N, D] for a shared-prompt
    stream (`shared_prompt_layout` in kwargs), output [1, N, H, D]. Without a layout: `fallback` (an SDPA
    attention function), so the model's other forwards (generation, left-padded batches) run as before."""
    layout: Optional[SharedPromptLayout] = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None:
        return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"a shared-prompt stream is one row; got a batch of {query.shape[0]}")
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise NotImplementedError("shared prompts do not reproduce attention logit soft-capping or position "
                                  "biases; set hardware.share_prompts=false for this model")
    window = kwargs.get("sliding_window")
    if layout.kernel == VARLEN:
        if dropout:
            raise NotImplementedError(f"attention dropout ({dropout}) with varlen flash shared prompts; set "
                                      "hardware.share_prompts=false for this model")
        return _varlen_attention(query, key, value, layout, scaling, window), None
    mask = layout.mask
    if window is not None:  # transformers' sliding window: a query sees the `window` positions up to itself
        keys = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & ((layout.query_positions[..., None] - keys) < window)[:, None]
    groups = query.shape[1] // key.shape[1]
    # [S, heads, slots, D] batches of each sequence's queries and keys (index_select: one kernel, and far less host
    # time than advanced indexing in eager passes); K/V heads repeated per query head so the memory-efficient kernel
    # runs (it takes a mask; flash does not, and only flash takes grouped heads)
    q, k, v = (_gather_slots(t, index) for t, index in ((query, layout.query_index), (key, layout.key_index),
                                                       (value, layout.key_index)))
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    heads, dim = out.shape[1], out.shape[3]
    out = out.transpose(1, 2).reshape(-1, heads, dim)  # [S * Lq, heads, D]
    return out.index_select(0, layout.slot_of_token)[None], None


def _gather_slots(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[1, heads, N, D] stream states at `index` [S, L] -> [S, heads, L, D]."""
    heads, dim = states.shape[1], states.shape[3]
    return states[0].index_select(1, index.flatten()).view(heads, *index.shape, dim).transpose(0, 1)


def varlen_attention_function() -> Optional[Callable]:
    """PyTorch's variable-length flash attention (torch.nn.attention.varlen.varlen_attn, torch >= 2.10), or None."""
    return machine.varlen_attention_function()


def _varlen_attention(query, key, value, layout: SharedPromptLayout, scaling, window) -> torch.Tensor:
    """[1, N, H, D]: each sequence's queries against its keys by flash varlen, causal from the bottom right (a
    sequence's queries are the last tokens of its keys), K/V heads grouped as they are."""
    # under autocast SDPA casts its inputs itself; the varlen op does not (RoPE leaves q and k in fp32 there)
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    q = query[0].transpose(0, 1).index_select(0, layout.query_order).to(dtype)  # [N, H, D], sequence by sequence
    k = key[0].transpose(0, 1).index_select(0, layout.key_gather).to(dtype)  # [Tk, KV, D]
    v = value[0].transpose(0, 1).index_select(0, layout.key_gather).to(dtype)
    attend = varlen_attention_function()
    grouped = {}
    if k.shape[1] != q.shape[1]:
        if _takes_grouped_heads(attend):
            grouped = {"enable_gqa": True}
        else:  # torch 2.10/2.11: equal head counts only
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    out = attend(q, k, v, layout.cu_queries, layout.cu_keys, layout.max_queries, layout.max_keys, scale=scaling,
                 window_size=(-1 if window is None else window - 1, 0), **grouped)
    return out.index_select(0, layout.token_order)[None]


@functools.lru_cache(maxsize=None)
def _takes_grouped_heads(attend: Callable) -> bool:
    return "enable_gqa" in inspect.signature(attend).parameters


__all__ = ["MASKED", "VARLEN", "KERNELS", "LAYOUT_KWARG", "SharedPromptLayout", "SharedPromptBatch", "pack_shared_prompts",
           "prompt_keys", "split_rows_keeping_prompts", "shared_prompt_attention", "varlen_attention_function"]
