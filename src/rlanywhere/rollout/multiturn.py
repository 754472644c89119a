"""Multi-turn, tool-using rollouts over any rollout engine.

A row's response is a conversation: the model's turn, then (when the turn holds hermes tool calls,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) the tools' results rendered as `tool` messages with the
model's own chat template, then the model's next turn, and so on, until a turn calls no tool, the turn limits
(`max_assistant_turns`, `max_user_turns`) are reached, or the response length (all turns together, tool results
included: verl's `response_length`) runs out. The result is one `RolloutBatch` whose `response_mask` has holes:
1 on tokens the model generated, 0 on tool-result tokens (they count for attention, not for the policy loss, KL,
entropy or advantages: verl's multi-turn `response_mask`), with log-prob 0 there.

Turn 0 is exactly the single-turn rollout (`engine.generate` with n samples per prompt). Each later turn generates
the continuing rows as new prompts (the history so far): the HF engine and FastEngine re-prefill it (FastEngine in
chunked prefills of many rows at once). Tools of every row run in parallel threads (tools.executor) between turns.

Sampling randomness: with `RowStreams` (the trainer's) every row draws from its own stream, keyed by its global
prompt and sample index, so the rows are the same whatever the rank, wave or rollout batch size: FastEngine's rows
continue one stream through their turns (counted by response position); a row generated again as a new prompt draws
its later turns from `TurnStreams` (its key and the turn). With a torch.Generator (or a function of the first prompt
index returning one), later turns draw per chunk of `rows_per_wave` rows by global row index, from a generator
seeded from the caller's for that chunk's prompt and the turn, so a rank whose rows are whole chunks draws what one
process draws for them.

`plan_multiturn_lengths` is the planner's pure function for the longer sequences (prompt + every turn).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..tools.base import BaseTool, accepts_keyword, call_tool_method
from ..tools.executor import run_calls
from ..tools.parsing import TOOL_CALL_OPEN, ToolCall, parse_tool_calls
from ..planner.multiturn import (MultiTurnConfigError, multiturn_values, plan_multiturn,  # noqa: F401
                                 plan_multiturn_lengths)
from ..vocabulary import FP32
from .base import RolloutBatch, RowStreams, SamplingParams, TurnStreams, left_pad

log = logging.getLogger(__name__)

TOOL_RESPONSE_ROLE = "tool"


@dataclass
class MultiTurnSettings:
    """verl's `actor_rollout_ref.rollout.multi_turn` settings that shape a rollout."""

    max_assistant_turns: int = 5
    max_user_turns: int = 5
    max_parallel_calls: int = 1  # calls executed per turn and row (verl: the first ones; the rest are ignored)
    max_tool_response_length: int = 256  # characters of a tool result the model sees
    tool_response_truncate_side: str = "middle"
    tool_timeout_s: float = 30.0


@dataclass
class RowStats:
    """What one row did: counts for the metrics."""

    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_latency_s: list = field(default_factory=list)
    tool_reward: float = 0.0
    reward_scores: dict = field(default_factory=dict)  # tool name -> calc_reward at the row's end (verl's layout)


@dataclass
class _Row:
    prompt: list[int]
    global_row: int
    tools_kwargs: dict
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_start: int = 0
    done: bool = False
    instances: dict = field(default_factory=dict)  # tool name -> instance id
    stats: RowStats = field(default_factory=RowStats)

    def add(self, tokens: Sequence[int], generated: bool, logprobs: Sequence[float] | None = None) -> None:
        self.tokens += list(tokens)
        self.mask += [1 if generated else 0] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)


# ---------------------------------------------------------------------------------------------------- chat template
def tool_prompt_text(tools: Sequence[BaseTool]) -> str:
    """A system text describing the tools in hermes style, for chat templates that do not render `tools=`."""
    import json

    lines = ["You can call tools. Available tools, as JSON schemas:", "<tools>"]
    lines += [json.dumps(t.get_openai_tool_schema()) for t in tools]
    lines += ["</tools>", "To call a tool, write one line per call: "
              '<tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call>',
              "The result comes back in a message from the tool; then continue, and give the final answer."]
    return "\n".join(lines)


def render_prompt_with_tools(tokenizer: Any, messages: list[dict], tools: Sequence[BaseTool],
                             chat_template_kwargs: dict | None = None) -> list[int]:
    """Prompt token ids with the tools described: through the chat template's own `tools=` where it renders them,
    else as a system message (prepended to the first system message if there is one). `chat_template_kwargs`:
    data.apply_chat_template_kwargs."""
    messages = [dict(m) for m in messages]
    schemas = [t.get_openai_tool_schema() for t in tools]
    extra = dict(chat_template_kwargs or {})
    text = None
    if tools:
        try:
            text = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=False,
                                                 **extra)
        except Exception:  # noqa: BLE001 - a template without tool support: describe them ourselves
            text = None
        plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        if text is not None and (text == plain or not all(t.name in text for t in tools)):
            text = None  # the template ignored tools=
        if text is None:
            description = tool_prompt_text(tools)
            if messages and messages[0].get("role") == "system":
                messages[0]["content"] = description + "\n\n" + str(messages[0]["content"])
            else:
                messages.insert(0, {"role": "system", "content": description})
    if text is None:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class ToolMessageRenderer:
    """Token ids appended after an assistant turn for its tool results: whatever the chat template writes after the
    assistant's end-of-turn token, the `tool` messages, and the next assistant header.

    Each text is cut from one rendering of a dummy conversation followed by the results, right after the dummy
    assistant's turn: templates render a last assistant message differently from an earlier one (Qwen3 adds an
    empty think block) and may stamp the date (Llama 3), so no part of another rendering is reused."""

    _USER, _ASSISTANT = "Hi.", "Hello."
    REMEMBERED = 4096  # rendered results kept

    def __init__(self, tokenizer: Any, eos_text: str | None, chat_template_kwargs: dict | None = None):
        self.tokenizer, self.eos_text = tokenizer, eos_text
        self.template_kwargs = dict(chat_template_kwargs or {})  # data.apply_chat_template_kwargs
        self._rendered: dict[tuple, list[int]] = {}
        self.base = [{"role": "system", "content": "s"}, {"role": "user", "content": self._USER},
                     {"role": "assistant", "content": self._ASSISTANT}]
        self.text(["probe"], True)  # a template that cannot render tool results fails here, before the run

    def _render(self, messages: list[dict], **options: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **options, **self.template_kwargs)

    def text(self, results: Sequence[str], turn_ended_by_eos: bool) -> str:
        full = self._render(self.base + [{"role": TOOL_RESPONSE_ROLE, "content": r} for r in results],
                            add_generation_prompt=True)
        lead = "" if turn_ended_by_eos else self.eos_text or ""  # a turn that ended otherwise is closed first
        # the dummy assistant's turn ends at its first "Hello.<eos>" (the system and user texts hold no "Hello.")
        at = full.find(self._ASSISTANT + self.eos_text) if self.eos_text else -1
        if at >= 0:
            return lead + full[at + len(self._ASSISTANT + self.eos_text):]
        prefix = self._render(self.base)  # a template that ends no turn with the EOS token: what follows the rest
        if not full.startswith(prefix):
            raise ValueError("the chat template renders earlier messages differently once a tool message follows, "
                             "and does not end an assistant turn with the tokenizer's EOS token; multi-turn rollouts "
                             "need a template that appends messages")
        return lead + full[len(prefix):]

    def ids(self, results: Sequence[str], turn_ended_by_eos: bool) -> list[int]:
        """The ids of `text`, remembered: rows often get the same results (a template render costs ~0.1 ms, paid
        by every row at every turn end while the KV path's wave waits)."""
        key = (tuple(results), turn_ended_by_eos)
        ids = self._rendered.get(key)
        if ids is None:
            if len(self._rendered) >= self.REMEMBERED:
                self._rendered.clear()
            ids = self._rendered[key] = list(self.tokenizer(self.text(results, turn_ended_by_eos),
                                                            add_special_tokens=False)["input_ids"])
        return list(ids)


# ---------------------------------------------------------------------------------------------------- the rollout
def _derived_generator(base: Optional[torch.Generator], turn: int, row: int, device: str) -> Optional[torch.Generator]:
    if base is None:
        return None
    out = torch.Generator(device=device)
    out.manual_seed((base.initial_seed() * 1_000_003 + turn * 7919 + row * 104_729) % (2**62))
    return out


class MultiTurnRollout:
    """Multi-turn generation with tools (see the module docstring). `last_stats` holds the rows of the last call."""

    def __init__(self, tools: Sequence[BaseTool], tokenizer: Any, settings: MultiTurnSettings,
                 eos_ids: Sequence[int], kv_continuation: bool = True, chat_template_kwargs: dict | None = None):
        self.tools = {t.name: t for t in tools}
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # data.apply_chat_template_kwargs
        self.tokenizer, self.settings, self.eos_ids = tokenizer, settings, set(int(e) for e in eos_ids)
        eos_id = getattr(tokenizer, "eos_token_id", None)
        eos_text = tokenizer.convert_ids_to_tokens(int(eos_id)) if eos_id is not None else None
        self.renderer = ToolMessageRenderer(tokenizer, eos_text, self.chat_template_kwargs)
        # the chat template's end of turn: a turn that ended on another EOS id (Qwen's <|endoftext|>) gets it
        # written before its tool messages, as the template would have closed the turn
        self.turn_end_id = None if eos_id is None else int(eos_id)
        # FastEngine: continue rows in their KV cache (multiturn_fast.py); False: re-prefill every turn
        self.kv_continuation = kv_continuation
        self.last_stats: list[RowStats] = []

    def prompt_ids(self, item: dict) -> list[int]:
        """The row's prompt: its input_ids, which the dataset rendered with the tools described (and cut or
        filtered to data.max_prompt_length); an item made elsewhere with tools: its raw chat rendered with them."""
        raw = item.get("raw_prompt")
        if self.tools and raw and not item.get("tools_in_input_ids"):
            return render_prompt_with_tools(self.tokenizer, list(raw), list(self.tools.values()),
                                            self.chat_template_kwargs)
        return list(item["input_ids"])

    def generate(self, engine: Any, items: list[dict], params: SamplingParams,
                 generator: Callable[[int], torch.Generator] | torch.Generator | None = None,
                 first_prompt: int = 0, rows_per_wave: Optional[int] = None) -> RolloutBatch:
        n, budget = params.n, params.max_new_tokens
        prompts = [self.prompt_ids(item) for item in items]
        rows = [_Row(prompts[i], (first_prompt + i) * n + j, dict((items[i].get("extra_info") or {})
                                                                    .get("tools_kwargs") or {}))
                for i in range(len(items)) for j in range(n)]
        source = (generator.offset(first_prompt) if isinstance(generator, RowStreams) else
                  (lambda offset: generator(first_prompt + offset)) if callable(generator) else generator)
        if self.kv_continuation and hasattr(engine, "runner") and hasattr(engine, "scheduler"):
            from .multiturn_fast import fast_multiturn_generate  # FastEngine: rows continue in their KV cache

            for row in rows:
                row.stats.assistant_turns = 1
            try:
                batch = fast_multiturn_generate(self, engine, rows, prompts, params, source, rows_per_wave)
            finally:
                self._release(rows)
            self.last_stats = [r.stats for r in rows]
            return batch
        first = engine.generate(prompts, params, generator=source, rows_per_wave=rows_per_wave)
        self._take_turn(rows, range(len(rows)), first)
        try:
            for turn in range(1, 10**6):
                continuing = self._run_tools(rows, budget)
                if not continuing:
                    break
                self._continue(engine, rows, continuing, params, generator, first_prompt, rows_per_wave, turn)
        finally:
            self._release(rows)
        self.last_stats = [r.stats for r in rows]
        return self._batch(rows, n, len(items), engine)

    # -- one turn's generated tokens into the rows
    def _take_turn(self, rows: list[_Row], indices: Sequence[int], batch: RolloutBatch) -> None:
        ids, mask, logprobs = batch.response_ids.tolist(), batch.response_mask.tolist(), batch.response_logprobs.tolist()
        for k, i in enumerate(indices):
            length = int(sum(mask[k]))
            row = rows[i]
            row.turn_start = len(row.tokens)
            row.add(ids[k][:length], True, logprobs[k][:length])
            row.stats.assistant_turns += 1

    def _continue(self, engine, rows, continuing, params, generator, first_prompt, rows_per_wave, turn) -> None:
        """Generate the next turn of the continuing rows, chunk by chunk of global row index."""
        chunk_rows = rows_per_wave or max(len(rows), 1)
        chunks: dict[int, list[int]] = {}
        for i in continuing:
            chunks.setdefault(rows[i].global_row // chunk_rows, []).append(i)
        for key in sorted(chunks):
            members = chunks[key]
            budget = max(params.max_new_tokens - len(rows[i].tokens) for i in members)
            turn_params = SamplingParams(max_new_tokens=budget, temperature=params.temperature, top_p=params.top_p,
                                         top_k=params.top_k, n=1, stop_strings=params.stop_strings, seed=params.seed,
                                         ignore_eos=params.ignore_eos)
            if isinstance(generator, RowStreams):  # each row its own stream for this turn
                gen = TurnStreams(generator.seed, rows=tuple(generator.first_prompt * params.n + rows[i].global_row
                                                            for i in members), n=params.n, turn=turn)
            else:
                first_row = rows[members[0]].global_row
                base = generator(first_row // params.n) if callable(generator) else generator
                gen = _derived_generator(base, turn, first_row, str(base.device) if base is not None else "cpu")
            out = engine.generate([rows[i].prompt + rows[i].tokens for i in members], turn_params, generator=gen,
                                  rows_per_wave=None)
            out_mask = out.response_mask.clone()
            for k, i in enumerate(members):  # each row stops at its own remaining budget
                out_mask[k, params.max_new_tokens - len(rows[i].tokens):] = 0
            self._take_turn(rows, members, RolloutBatch(out.prompt_ids, out.prompt_mask, out.response_ids, out_mask,
                                                        out.response_logprobs, out.num_prompts, out.n))

    # -- tools between turns
    def _run_tools(self, rows: list[_Row], budget: int) -> list[int]:
        """Parse the last turn of every open row, run all calls in parallel, append results; the rows that go on."""
        settings, jobs, owners = self.settings, [], []
        for i, row in enumerate(rows):
            if row.done:
                continue
            turn = row.tokens[row.turn_start:]
            ended_by_eos = bool(turn) and turn[-1] == self.turn_end_id
            text = self.tokenizer.decode(turn, skip_special_tokens=False)
            calls = parse_tool_calls(text, set(self.tools))
            out_of_room = len(row.tokens) >= budget
            if not calls or out_of_room:
                row.stats.tool_errors += sum(1 for c in calls if c.error is not None)  # e.g. a call cut off
                row.stats.tool_calls += len(calls)
                row.done = True
                continue
            if (row.stats.assistant_turns >= settings.max_assistant_turns
                    or row.stats.user_turns >= settings.max_user_turns):
                row.done = True
                continue
            calls = calls[:max(settings.max_parallel_calls, 1)]
            for call in calls:
                jobs.append((self._tool_for(row, call), self._instance(row, call), call))
            owners.append((i, len(calls), ended_by_eos))
        if not jobs:
            return []
        results = run_calls(jobs, settings.tool_timeout_s, settings.max_tool_response_length,
                            settings.tool_response_truncate_side)
        continuing, at = [], 0
        for i, count, ended_by_eos in owners:
            row, mine = rows[i], results[at:at + count]
            at += count
            row.stats.tool_calls += count
            row.stats.tool_errors += sum(r.error for r in mine)
            row.stats.tool_latency_s += [r.latency_s for r in mine]
            row.stats.tool_reward += sum(r.reward for r in mine)
            appended = self.renderer.ids([r.text for r in mine], ended_by_eos)
            if len(row.tokens) + len(appended) >= budget:  # no room left for the model to answer: the row ends
                row.done = True
                continue
            row.add(appended, False)
            row.stats.user_turns += 1  # a tool turn the model saw (as verl counts them)
            continuing.append(i)
        return continuing

    def _tool_for(self, row: _Row, call: ToolCall) -> Optional[BaseTool]:
        return self.tools.get(call.name) if call.error is None else None

    def _instance(self, row: _Row, call: ToolCall) -> str:
        """The row's instance of the called tool, created at its first call with the row's create_kwargs."""
        tool = self._tool_for(row, call)
        if tool is None:
            return ""
        if call.name not in row.instances:
            kwargs = dict((row.tools_kwargs.get(call.name) or {}).get("create_kwargs") or {})
            if "create_kwargs" not in kwargs and accepts_keyword(tool.create, "create_kwargs"):
                kwargs["create_kwargs"] = dict(kwargs)  # verl's agent loop passes them as one dict of that name
            try:
                instance_id, _ = call_tool_method(tool.create, None, **kwargs)
            except Exception as err:  # noqa: BLE001 - a tool that cannot start: its calls get the error
                log.warning("tool %s: create failed (%s)", call.name, err)
                call.error = f"Error: the tool {call.name} could not start ({type(err).__name__}: {err})"
                return ""
            row.instances[call.name] = instance_id
        return row.instances[call.name]

    def _release(self, rows: list[_Row]) -> None:
        """Score each row's tool instances (`calc_reward`, verl's reward_scores) and release them."""
        for row in rows:
            for name, instance_id in row.instances.items():
                try:
                    row.stats.reward_scores[name] = float(call_tool_method(self.tools[name].calc_reward, instance_id))
                except Exception as err:  # noqa: BLE001 - a tool that cannot score: no score, the run goes on
                    log.warning("tool %s: calc_reward failed (%s)", name, err)
                try:
                    call_tool_method(self.tools[name].release, instance_id)
                except Exception as err:  # noqa: BLE001 - release problems must not stop the run
                    log.warning("tool %s: release failed (%s)", name, err)
            row.instances.clear()

    def _batch(self, rows: list[_Row], n: int, num_prompts: int, engine: Any) -> RolloutBatch:
        pad = int(getattr(engine, "pad_token_id", None) or self.tokenizer.pad_token_id or 0)
        width = max(max(len(r.tokens) for r in rows), 1)
        response_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        response_mask = torch.zeros((len(rows), width), dtype=torch.long)
        logprobs = torch.zeros((len(rows), width), dtype=FP32)
        for k, r in enumerate(rows):
            response_ids[k, :len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
            response_mask[k, :len(r.mask)] = torch.tensor(r.mask, dtype=torch.long)
            logprobs[k, :len(r.logprobs)] = torch.tensor(r.logprobs, dtype=FP32)
        prompt_ids, prompt_mask = left_pad([r.prompt for r in rows], pad)
        return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, logprobs, num_prompts, n)


# ---------------------------------------------------------------------------------------------------- reward inputs
def reward_extra_infos(extra_infos: Sequence[Optional[dict]], stats: Sequence[RowStats]) -> list[dict]:
    """Each row's `extra_info` for the reward function with what verl's reward managers add after a multi-turn
    rollout: `num_turns` (the prompt, every assistant and tool turn) and `rollout_reward_scores` (tool name ->
    the tool's `calc_reward` for that row). Copies: rows of one prompt share its extra_info dict."""
    if len(extra_infos) != len(stats):
        raise ValueError(f"reward_extra_infos got {len(extra_infos)} extra_info rows for {len(stats)} rollout rows")
    return [{**(info or {}), "num_turns": s.assistant_turns + s.user_turns + 1,
             "rollout_reward_scores": dict(s.reward_scores)} for info, s in zip(extra_infos, stats)]


# ---------------------------------------------------------------------------------------------------- metrics / plan
def multiturn_metrics(stats: Sequence[RowStats], prefix: str = "multi_turn") -> dict[str, float]:
    """Per-step summaries of the rows' turn counts, tool calls, errors, latency and tool rewards."""
    if not stats:
        return {}
    rows = float(len(stats))
    latencies = [s for r in stats for s in r.tool_latency_s]
    calls = sum(r.tool_calls for r in stats)
    return {
        f"{prefix}/assistant_turns/mean": sum(r.assistant_turns for r in stats) / rows,
        f"{prefix}/assistant_turns/max": float(max(r.assistant_turns for r in stats)),
        f"{prefix}/user_turns/mean": sum(r.user_turns for r in stats) / rows,
        f"{prefix}/tool_calls/mean": calls / rows,
        f"{prefix}/tool_calls/total": float(calls),
        f"{prefix}/tool_call_rate": sum(1 for r in stats if r.tool_calls) / rows,
        f"{prefix}/tool_errors/total": float(sum(r.tool_errors for r in stats)),
        f"{prefix}/tool_error_rate": (sum(r.tool_errors for r in stats) / calls) if calls else 0.0,
        f"{prefix}/tool_latency_s/mean": (sum(latencies) / len(latencies)) if latencies else 0.0,
        f"{prefix}/tool_latency_s/max": max(latencies) if latencies else 0.0,
        f"{prefix}/tool_reward/mean": sum(r.tool_reward for r in stats) / rows,
    }


__all__ = ["MultiTurnRollout", "MultiTurnSettings", "RowStats", "multiturn_metrics", "reward_extra_infos", "plan_multiturn_lengths",
           "prompt_render_with_tools", "render_prompt_with_tools", "ToolMessageRenderer", "tool_prompt_text", "TOOL_CALL_OPEN"]


# ---------------------------------------------------------------------------------------------------- from the config
def multiturn_settings(mt: Any) -> MultiTurnSettings:
    """Settings from `actor_rollout_ref.rollout.multi_turn`, checked (planner/multiturn.py reads them)."""
    return MultiTurnSettings(**multiturn_values(mt))


def multiturn_from_config(cfg: Any, tokenizer: Any, eos_ids: Sequence[int]) -> Optional[MultiTurnRollout]:
    """The run's MultiTurnRollout, or None when multi_turn.enable is off."""
    from ..data.loader import chat_template_kwargs as template_kwargs

    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return None
    settings = multiturn_settings(mt)
    tools = configured_tools(mt)
    return MultiTurnRollout(tools, tokenizer, settings, eos_ids,
                            chat_template_kwargs=template_kwargs(cfg.data))


def configured_tools(mt: Any) -> list[BaseTool]:
    """The tools `actor_rollout_ref.rollout.multi_turn` names (its tool_config_path), none when it is off."""
    from ..tools.registry import load_tool_config

    return load_tool_config(mt.tool_config_path) if mt.enable and mt.tool_config_path else []


def prompt_render_with_tools(cfg: Any, tokenizer: Any) -> Callable[[list[dict]], list[int]] | None:
    """For the dataset: the prompt ids a multi-turn rollout starts from (the tools described), so that prompt
    lengths, data.filter_overlong_prompts and data.truncation count the tools' text; None without tools."""
    from ..data.loader import chat_template_kwargs as template_kwargs

    tools = configured_tools(cfg.actor_rollout_ref.rollout.multi_turn)
    if not tools:
        return None
    kwargs = template_kwargs(cfg.data)
    return lambda messages: render_prompt_with_tools(tokenizer, messages, tools, kwargs)


__all__ += ["multiturn_settings", "multiturn_from_config", "plan_multiturn", "MultiTurnConfigError"]
