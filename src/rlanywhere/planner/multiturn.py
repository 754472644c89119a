"""Multi-turn rollouts in the plan: the settings checked, and how many tokens a sequence holds when the model calls
tools.

Every turn, the model's and the tools', lives inside the response length (verl's rule), so a sequence is the prompt,
the tools' descriptions the chat template adds to it, and the response length. Pure: reads the config and the tool
config's names (the tools themselves are built, and their classes checked, by the rollout and by preflight.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UserError

KEY = "actor_rollout_ref.rollout.multi_turn"


class MultiTurnConfigError(UserError, ValueError):
    """A multi_turn setting that cannot work; the message names the key and the fix."""


def multiturn_values(mt: Any) -> dict:
    """The checked settings of `actor_rollout_ref.rollout.multi_turn` (verl's keys; `max_turns`, older verl's name for
    `max_assistant_turns`, is accepted), as MultiTurnSettings' fields. Checked whether or not multi-turn is on, so a
    bad value is named before it matters."""
    older_name = mt.max_turns if "max_turns" in mt else None  # older verl releases' key
    assistant = mt.max_assistant_turns if mt.max_assistant_turns is not None else older_name
    assistant = 5 if assistant is None else int(assistant)
    user = int(mt.max_user_turns) if mt.max_user_turns is not None else assistant
    if str(mt.format) != "hermes":
        raise MultiTurnConfigError(f"{KEY}.format={mt.format!r} is not supported; use hermes "
                                   "(<tool_call>{json}</tool_call>)")
    if assistant < 1 or user < 0:
        raise MultiTurnConfigError(f"{KEY}.max_assistant_turns must be >= 1 and max_user_turns >= 0; got {assistant} "
                                   f"and {user}")
    if mt.tool_response_truncate_side not in ("left", "middle", "right"):
        raise MultiTurnConfigError(f"{KEY}.tool_response_truncate_side={mt.tool_response_truncate_side!r}: use left, "
                                   "middle or right")
    if int(mt.max_parallel_calls) < 1 or int(mt.max_tool_response_length) < 1 or float(mt.tool_timeout_s) <= 0:
        raise MultiTurnConfigError(f"{KEY}.max_parallel_calls, max_tool_response_length and tool_timeout_s must be "
                                   "positive")
    return dict(max_assistant_turns=assistant, max_user_turns=user, max_parallel_calls=int(mt.max_parallel_calls),
                max_tool_response_length=int(mt.max_tool_response_length),
                tool_response_truncate_side=str(mt.tool_response_truncate_side),
                tool_timeout_s=float(mt.tool_timeout_s))


def tool_names(path: str) -> list[str]:
    """The function names a verl tool config declares (tool_schema.function.name, else the class name)."""
    from omegaconf import OmegaConf

    if not path or not Path(path).is_file():
        return []
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    except Exception:  # noqa: BLE001 - an unreadable file is preflight's error to report, with its reason
        return []
    names = []
    for tool in (data.get("tools") or []) if isinstance(data, dict) else []:
        if not isinstance(tool, dict):
            continue
        function = ((tool.get("tool_schema") or {}).get("function") or {})
        names.append(str(function.get("name") or str(tool.get("class_name", "?")).rsplit(".", 1)[-1]))
    return names


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
    values = multiturn_values(mt)
    tool_config = mt.tool_config_path  # read either way: a path given with multi-turn off is simply unused
    if not mt.enable:
        return prompt_length, ""
    response = int(cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length)
    total, reason = plan_multiturn_lengths(True, prompt_length, response, values["max_assistant_turns"],
                                           values["max_user_turns"])
    return total - response, f"{reason}; tools: {', '.join(tool_names(tool_config)) or 'none'}"


__all__ = ["MultiTurnConfigError", "multiturn_values", "plan_multiturn", "plan_multiturn_lengths", "tool_names"]
