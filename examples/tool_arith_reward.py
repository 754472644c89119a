"""Reward of the calculator demo (examples/tool_arith.yaml), in verl's custom_reward_function signature.

1.0 for the right answer (the number after "####" in the model's own text; tool results are not part of it), plus
a small tool-use term: 0.1 when the row's calculator calls evaluated an expression (the calculator's calc_reward,
which reaches the reward as extra_info["rollout_reward_scores"], as in verl). The shaping is small against a right
answer, so a call never pays more than being right; it gives GRPO a signal to rank while answers are still wrong.
"""

from rlanywhere.rewards import arithmetic_score

TOOL_USE_SCORE = 0.1


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    result = arithmetic_score(solution_str, ground_truth)
    used_tool = float(((extra_info or {}).get("rollout_reward_scores") or {}).get("calculator", 0.0) > 0)
    return {**result, "score": result["score"] + TOOL_USE_SCORE * used_tool, "tool_used": used_tool}
