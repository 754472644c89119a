"""The gsm8k_format recipe's reward (custom_reward_function.path): GSM8K's strict `#### n` rule plus 0.1 for a
well-formed wrong `#### n`, so a model that starts near 0 % accuracy gets a signal. The rule lives in
rlanywhere.rewards.gsm8k_format_reward; this file only names it the way verl's config expects."""

from rlanywhere.rewards import gsm8k_format_reward as compute_score  # noqa: F401
