"""The decode runner: the KV cache, the static decode buffers and CUDA graphs around one model forward.

One job: run prefills and decode steps of `LlamaForward` on device memory it owns. Public API (the scheduler and
the benches use only this):

- `reserve(rows, length)`: make room for `rows` sequences of `length` slots (grows the cache, never shrinks);
- `prefill(ids, lengths, copies, row_start)`: prompts once each, their K/V copied to their sample rows;
- `load_rows(tokens, positions, starts)`: the decode state of rows [:batch] after a prefill;
- `decode_step(batch, slot)`: logits [batch, vocab] for the next token of rows [:batch] (a CUDA graph replay per
  (batch bucket, attention span) when graphs are on, else eager);
- `decode_sample(batch, slot)`: the same step with the sampling inside it (rollout/fused_sampling.py: one Triton
  pass over the logits, in the same graph): (tokens, log-probs) of rows [:batch], after `set_sampling`;
- `wait_for_steps()`: the host waits, asleep, for the steps queued so far (before reading their results);
- `advance(tokens)`: feed the sampled tokens back; `compact(active, batch, used_slots)`: move the active rows to
  the front of a smaller bucket; `release()`: free the cache, buffers and graphs.

Layout: left-padded rows; every row writes its next key/value to the same cache slot and a per-row start offset
(`KVCache.starts`) masks the padding, so a decode step has one fixed shape for the whole batch.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from ..vocabulary import DECODE_HALF_MIN_ROWS, FP32
from . import kernel_compiles
from .fused_sampling import sample_into
from .llama import LlamaForward, ModelDims

logger = logging.getLogger(__name__)

_CAPTURE_SECONDS = [0.0]  # every runner's CUDA-graph captures in this process (warm-up run included)


def graph_capture_seconds_so_far() -> float:
    """Seconds this process has spent capturing decode-step CUDA graphs (each graph's eager warm-up step, the
    capture itself and the kernels first compiled in them) and compiling decode kernels ahead of their steps."""
    return _CAPTURE_SECONDS[0]


CACHE_SLOT_ALIGNMENT = 16  # cache length rounded up to this (aligned rows for the attention kernels)


class KVCache:
    """Static key/value cache `[layers, rows, kv_heads, length, head_dim]` plus each row's first valid slot.

    Rows are sequences; a prompt of width P left-padded to the wave's width W starts at slot W - P (`starts`).
    """

    def __init__(self, dims: ModelDims, dtype: torch.dtype, device: torch.device):
        self.dims, self.dtype, self.device = dims, dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.starts: torch.Tensor | None = None  # [rows] long
        self.rows = 0
        self.length = 0

    def ensure(self, rows: int, length: int, keep_contents: bool = False) -> bool:
        """Grow to at least `rows` x `length` (length rounded up to CACHE_SLOT_ALIGNMENT); never shrinks.

        Returns True when it reallocated (tensors moved). keep_contents copies the old rows/slots into the new
        tensors (old and new live together for a moment); without it the old cache is freed first, so the peak is
        the new cache alone: the runner grows only between waves, when nothing in the cache is needed any more.
        """
        if self.fits(rows, length):
            return False
        rows = max(rows, self.rows)
        length = int(math.ceil(max(length, self.length) / CACHE_SLOT_ALIGNMENT) * CACHE_SLOT_ALIGNMENT)
        old = (self.k, self.v, self.starts, self.rows, self.length) if keep_contents else None
        self.k = self.v = self.starts = None
        d = self.dims
        shape = (d.layers, rows, d.kv_heads, length, d.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.starts = torch.zeros(rows, dtype=torch.long, device=self.device)
        if old is not None and old[0] is not None:
            k, v, starts, old_rows, old_length = old
            self.k[:, :old_rows, :, :old_length] = k
            self.v[:, :old_rows, :, :old_length] = v
            self.starts[:old_rows] = starts
        self.rows, self.length = rows, length
        logger.info("FastEngine KV cache: %d rows x %d slots (%.2f GiB, %s)", rows, length,
                    self.nbytes() / 2**30, self.dtype)
        return True

    def fits(self, rows: int, length: int) -> bool:
        return self.k is not None and rows <= self.rows and length <= self.length

    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def store_prompt(self, layer: int, row_start: int, k: torch.Tensor, v: torch.Tensor, copies: torch.Tensor,
                     rows: int) -> None:
        """Write one layer's prompt keys/values k, v [U, kv_heads, W, D] into rows row_start.., prompt u copied
        to `copies[u]` consecutive rows (its samples): the prompt is computed once, shared by its samples."""
        width = k.shape[2]
        end = row_start + rows
        self.k[layer, row_start:end, :, :width] = k.repeat_interleave(copies, dim=0, output_size=rows)
        self.v[layer, row_start:end, :, :width] = v.repeat_interleave(copies, dim=0, output_size=rows)

    def append(self, layer: int, batch: int, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               span: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one decode step's k, v [batch, kv_heads, 1, D] at cache slot `slot` ([1] long, on the device:
        no host read, so graph-capturable) of rows start..start+batch; return those rows' keys/values of slots
        [:span]."""
        k_rows, v_rows = self.k[layer, start:start + batch], self.v[layer, start:start + batch]
        k_rows.index_copy_(2, slot, k)
        v_rows.index_copy_(2, slot, v)
        return k_rows[:, :, :span], v_rows[:, :, :span]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values [rows, kv_heads, length, head_dim] (views)."""
        return self.k[layer], self.v[layer]

    def rows_from(self, start: int) -> "KVCache | KVRows":
        """The cache as seen by a decode pass over rows start.. (its row 0 is cache row `start`)."""
        return self if start == 0 else KVRows(self, start)

    def compact(self, index: torch.Tensor, used_slots: int) -> None:
        """Rows `index` (long [batch], on the device) become rows [:batch], slots [:used_slots] and start offsets
        kept; the rows after them are left as they were."""
        batch = index.numel()
        self.k[:, :batch, :, :used_slots] = self.k[:, index, :, :used_slots]
        self.v[:, :batch, :, :used_slots] = self.v[:, index, :, :used_slots]
        self.starts[:batch] = self.starts[index]

    def release(self) -> None:
        self.k = self.v = self.starts = None
        self.rows = self.length = 0


class KVRows:
    """The decode-step interface of a KVCache (`append`, `layer`) over its rows start..: the second half of a
    batch decoded on its own stream (DecodeRunner.decode_halves)."""

    def __init__(self, cache: KVCache, start: int):
        self.cache, self.start = cache, start

    def append(self, layer: int, batch: int, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               span: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.append(layer, batch, slot, k, v, span, start=self.start)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.k[layer, self.start:], self.cache.v[layer, self.start:]


class DecodeRunner:
    """KV cache, static buffers and CUDA graphs around one `LlamaForward` (see the module docstring)."""

    def __init__(self, forward: LlamaForward, cuda_graphs: bool, span_granularity: int = 256,
                 fused_sampling: bool = False, decode_halves: bool = False):
        self.forward = forward
        self.device, self.dtype = forward.device, forward.dtype
        self.cuda_graphs = cuda_graphs
        # steps of >= 2 x DECODE_HALF_MIN_ROWS rows as two halves on two CUDA streams (RolloutPlan.decode_halves)
        self.decode_halves = decode_halves
        self._streams: list[Any] = []
        self.fused_sampling = fused_sampling  # decode_sample available (Triton runs here)
        self._keyed = False  # decode_sample draws from each row's stream (set_sampling's row_keys)
        self.span_granularity = span_granularity
        self.cache = KVCache(forward.dims, forward.dtype, forward.device)
        self._graphs: dict[tuple[int, int, bool], Any] = {}
        self._graph_pool = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._rehearsed: set[tuple[bool, bool]] = set()  # kinds of step whose Triton kernels are compiled
        self._steps_done = None  # wait_for_steps's event (CUDA)

    # ---------------------------------------------------------------------------------------------- capacity
    @property
    def rows_capacity(self) -> int:
        return self.cache.rows

    def reserve(self, rows: int, length: int) -> None:
        """Room for `rows` sequences of `length` slots: cache, decode buffers and RoPE tables (graphs dropped when
        anything moves)."""
        if self.cache.fits(rows, length):
            return
        self.drop_graphs()  # graphs and buffers first: the new cache is allocated with their memory back
        self._buffers = {}
        self._rehearsed.clear()  # new tensors: their kernels are rehearsed again (compiled already, as a rule)
        self.cache.ensure(rows, length)
        rows, length = self.cache.rows, self.cache.length
        long = dict(dtype=torch.long, device=self.device)
        cos, sin = self.forward.rope_tables(length)
        self._buffers = {
            "tokens": torch.zeros(rows, **long),
            "positions": torch.zeros(rows, **long),
            "slot": torch.zeros(1, **long),
            "slot_range": torch.arange(length, **long),
            "logits": torch.zeros(rows, self.forward.dims.vocab, dtype=FP32, device=self.device),
            "cos": cos,
            "sin": sin,
            # the fused sampler's inputs (set per wave) and outputs
            "seed": torch.zeros(1, **long),
            "row_keys": torch.zeros(rows, **long),  # each row's stream key (keyed sampling), compacted with it
            "position": torch.zeros(1, **long),  # the response position a keyed step samples
            "temperature": torch.ones(1, dtype=FP32, device=self.device),
            "sampled": torch.zeros(rows, **long),
            "sampled_logprobs": torch.zeros(rows, dtype=FP32, device=self.device),
        }

    def release(self) -> None:
        """Free the KV cache, static buffers and CUDA graphs; the next reserve allocates them again."""
        self.drop_graphs()
        self.cache.release()
        self._buffers = {}

    def wait_for_steps(self) -> None:
        """Wait, asleep, for the work queued on this thread's stream, so that the host reads that follow (the
        scheduler's checks, the request's outputs) find it done. A host read waits for the GPU by spinning a CPU
        core; beside a training step (trainer.async overlapped) that core is one the update's CPU thread pool
        shares, and every parallel CPU operator of the update then waits for the thread it lost (measured: the
        update's CPU indexing took 0.15 s of a 0.69 s update instead of 1.5 ms). An event with blocking sync lets
        the thread sleep instead."""
        if self.device.type != "cuda":
            return
        if self._steps_done is None:
            self._steps_done = torch.cuda.Event(blocking=True)
        self._steps_done.record(torch.cuda.current_stream(self.device))
        self._steps_done.synchronize()

    def drop_graphs(self) -> None:
        self._graphs.clear()
        self._graph_pool = None

    def sync_weights(self) -> None:
        """Refresh the forward's weight copies; graphs captured with moved tensors are dropped."""
        if self.forward.weights.sync():
            self.drop_graphs()

    def bucket(self, rows: int) -> int:
        """Decode batch for `rows` active rows: the smallest power of two >= rows, at least 2 (compiled kernels
        specialize a batch of 1: a last long row would recompile them mid-run), capped at the cache's rows (few
        distinct shapes, so few CUDA graphs)."""
        return min(max(2, 1 << max(rows - 1, 0).bit_length()), self.cache.rows)

    def span(self, slot: int) -> int:
        """Cache slots the attention reads at a step writing `slot`: slot+1 rounded up to the plan's span
        granularity, bounded by the cache length."""
        step = self.span_granularity
        return min(self.cache.length, int(math.ceil((slot + 1) / step) * step))

    # ----------------------------------------------------------------------------------------------- passes
    def _rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._buffers["cos"], self._buffers["sin"]

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, copies: torch.Tensor, row_start: int) -> torch.Tensor:
        """Left-padded prompts ids [U, W] (lengths [U]) into cache rows row_start.. (prompt u to copies[u] rows);
        returns their last-position logits [U, vocab] fp32. Call `reserve` first."""
        return self.forward.prefill(ids, lengths, copies, row_start, self._rope(), self.cache)

    def load_rows(self, tokens: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor) -> None:
        """Decode state of rows [:batch]: the token each feeds next, its position, its first valid cache slot."""
        batch = tokens.numel()
        self._buffers["tokens"][:batch] = tokens
        self._buffers["positions"][:batch] = positions
        self.cache.starts[:batch] = starts

    def advance(self, tokens: torch.Tensor) -> None:
        """Rows [:batch] feed `tokens` next, one position further on."""
        batch = tokens.numel()
        self._buffers["tokens"][:batch] = tokens
        self._buffers["positions"][:batch] += 1

    def compact(self, active: torch.Tensor, batch: int, used_slots: int) -> None:
        """Move the `active` rows to the front of a `batch`-row bucket (filler rows repeat the first active row)."""
        count = active.numel()
        index = torch.cat([active, active[:1].expand(batch - count)]) if batch > count else active
        self.cache.compact(index, used_slots)
        for name in ("tokens", "positions", "row_keys"):
            buf = self._buffers[name]
            buf[:batch] = buf[index]

    def set_sampling(self, seed: torch.Tensor, temperature: float, row_keys: torch.Tensor | None = None) -> None:
        """The fused sampler's seed ([1] int64 on the device: drawn from the wave's generator, no host read) and
        temperature (0: greedy) for the following `decode_sample` steps. row_keys (int64 [batch] on the device,
        `RowStreams.keys` of the batch's rows): each row samples from its own stream at the response position
        `decode_sample` is given, and the seed is not used."""
        self._keyed = row_keys is not None
        self._buffers["temperature"].fill_(temperature)
        if self._keyed:  # the keys are the whole stream: no seed of the wave's
            self._buffers["seed"].zero_()
            self._buffers["row_keys"][:row_keys.numel()].copy_(row_keys)
        else:
            self._buffers["seed"].copy_(seed)

    def _decode_into_buffer(self, batch: int, span: int, sample: bool) -> None:
        if not (self.decode_halves and batch >= 2 * DECODE_HALF_MIN_ROWS):
            self._decode_rows(0, batch, span, sample)
            return
        self._decode_two_halves(batch, span, sample)

    def _decode_rows(self, start: int, rows: int, span: int, sample: bool) -> None:
        """One decode step of rows start..start+rows: their logits into the static buffers, or their sampled
        tokens and log-probs."""
        b, end = self._buffers, start + rows
        logits = self.forward.decode(b["tokens"][start:end], b["positions"][start:end], self.cache.starts[start:end],
                                     b["slot"], b["slot_range"][:span], self._rope(), self.cache.rows_from(start))
        if sample and self._keyed:  # each row's stream, counted by the response position
            sample_into(logits, b["seed"], b["position"], b["temperature"], b["sampled"][start:end],
                        b["sampled_logprobs"][start:end], row_offset=start, row_keys=b["row_keys"])
        elif sample:  # the decode step's slot counts the noise: each step draws afresh
            sample_into(logits, b["seed"], b["slot"], b["temperature"], b["sampled"][start:end],
                        b["sampled_logprobs"][start:end], row_offset=start)
        else:
            b["logits"][start:end].copy_(logits)

    def _decode_two_halves(self, batch: int, span: int, sample: bool) -> None:
        """A decode step as two independent halves of the batch, each on its own CUDA stream: one half's
        latency-bound kernels (attention, norms, small GEMMs) run while the other's GEMMs hold the GPU. The CUDA
        graph captures the two streams as two branches. (Forcing turns with events, one half's attention beside
        the other's MLP, measured slower than letting the two streams run freely.) On a CPU (tests) the halves
        run one after the other."""
        half = batch // 2
        parts = ((0, half), (half, batch - half))
        if self.device.type != "cuda":
            for start, rows in parts:
                self._decode_rows(start, rows, span, sample)
            return
        main = torch.cuda.current_stream(self.device)
        if not self._streams:
            self._streams = [torch.cuda.Stream(self.device) for _ in parts]
        for stream, (start, rows) in zip(self._streams, parts):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                self._decode_rows(start, rows, span, sample)
        for stream in self._streams:
            main.wait_stream(stream)

    def decode_step(self, batch: int, slot: int, span: int | None = None, eager: bool = False) -> torch.Tensor:
        """Logits [batch, vocab] (a view of a static buffer) for the next token of rows [:batch], writing their
        keys/values at cache slot `slot`. span: slots attention reads (default `self.span(slot)`); eager: skip
        the CUDA graph (profiling)."""
        self._run_step(batch, slot, span, eager, sample=False)
        return self._buffers["logits"][:batch]

    def decode_sample(self, batch: int, slot: int, span: int | None = None, eager: bool = False,
                      position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode_step` with the next token drawn inside the step (the fused sampler, `set_sampling` first):
        (tokens [batch] long, log-probs [batch] fp32), views of static buffers. position: the response position
        (keyed sampling counts each row's noise by it)."""
        if not self.fused_sampling:
            raise RuntimeError("decode_sample needs a runner built with fused_sampling=True (Triton)")
        self._buffers["position"].fill_(position)
        self._run_step(batch, slot, span, eager, sample=True)
        return self._buffers["sampled"][:batch], self._buffers["sampled_logprobs"][:batch]

    def _run_step(self, batch: int, slot: int, span: int | None, eager: bool, sample: bool) -> None:
        span = self.span(slot) if span is None else span
        self._buffers["slot"].fill_(slot)
        self._compile_kernels(batch, span, sample)
        if eager or not self.cuda_graphs:
            self._decode_into_buffer(batch, span, sample)
            return
        key = (batch, span, sample, sample and self._keyed)
        graph = self._graphs.get(key)
        if graph is None:
            captured_from = time.perf_counter()
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            # Warm up on a side stream (lazy kernel/cuBLAS init); it recomputes exactly this step, so the cache
            # write it makes is the one the replay makes.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._decode_into_buffer(batch, span, sample)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a rollout capturing in its own thread while the update runs (async_pipeline.py)
            with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
                self._decode_into_buffer(batch, span, sample)
            self._graphs[key] = graph
            _CAPTURE_SECONDS[0] += time.perf_counter() - captured_from
        graph.replay()

    def _compile_kernels(self, batch: int, span: int, sample: bool) -> None:
        """Before a new kind of step (sampling or not, keyed or not) first runs, its Triton kernels compiled side by
        side (kernel_compiles.py) instead of one after another as the step launches them: a rehearsal of the step
        at this batch and at the smallest bucket (whose attention splits the slots and merges them). It runs the
        steps' torch ops; whatever they write (logits, rows [:batch] at `slot`) the step itself writes again."""
        kind = (sample, sample and self._keyed)
        launches_triton = self.forward.launches_triton or sample  # sample: the fused sampler's kernels
        if kind in self._rehearsed or not launches_triton or not kernel_compiles.available(self.device):
            return
        self._rehearsed.add(kind)
        started = time.perf_counter()
        with kernel_compiles.side_by_side():
            for rows in sorted({batch, self.bucket(1)}):
                self._decode_into_buffer(rows, span, sample)
        _CAPTURE_SECONDS[0] += time.perf_counter() - started


__all__ = ["KVCache", "DecodeRunner", "graph_capture_seconds_so_far"]
