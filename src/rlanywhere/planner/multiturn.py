"""Multi-turn rollouts in the memory plan: how many tokens a sequence holds when the model calls tools.

Every turn, the model's and the tools', lives inside the response length (verl's rule), so a sequence is the prompt,
the tools' descriptions the chat template adds to it, and the response length. Pure: reads the config only (the
settings and the tool config are checked before anything loads, by the rollout's own reader).
"""

from __future__ import annotations

from typing import Any


def plan_multiturn_lengths(enabled: bool, prompt_length: int, response_length: int, max_assistant_turns: int,
                           max_user_turns: int) -> tuple[int, str]:
    """Tokens per sequence the memory plan must hold with multi-turn rollouts, and the reason in a user's words.
    The tool-describing system text is counted as a quarter more prompt (at least 128 tokens)."""
    if not enabled:
        return prompt_length + response_length, "single-turn: prompt + response"
    tool_text = max(128, prompt_length // 4)
    total = prompt_length + tool_text + response_length
    return total, (f"multi-turn: prompt ({prompt_length}) + tool descriptions (~{tool_text}) + all turns within the "
                   f"response length ({response_length}; up to {max_assistant_turns} model turns and "
                   f"{max_user_turns} tool results)")


def plan_multiturn(cfg: Any, prompt_length: int) -> tuple[int, str]:
    """(prompt tokens to plan for, reason; "" when multi-turn is off)."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return prompt_length, ""
    older_name = mt.max_turns if "max_turns" in mt else None  # older verl releases' key
    assistant = mt.max_assistant_turns if mt.max_assistant_turns is not None else older_name
    assistant = 5 if assistant is None else int(assistant)
    user = int(mt.max_user_turns) if mt.max_user_turns is not None else assistant
    response = int(cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length)
    total, reason = plan_multiturn_lengths(True, prompt_length, response, assistant, user)
    return total - response, reason


__all__ = ["plan_multiturn", "plan_multiturn_lengths"]
