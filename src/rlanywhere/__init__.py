"""rlanywhere: RL post-training of LLMs that plans itself around the hardware you have.

The Python API (rlanywhere.api; the same objects the CLI uses), imported on first use so that `import rlanywhere`
and `rlanywhere --version` stay instant:

    import rlanywhere as rl
    cfg = rl.make_config("examples/grpo_gsm8k.yaml", ["data.train_batch_size=8"])
    result = rl.train(cfg, rl.plan(cfg))
    print(rl.evaluate(result.final_model, "data/gsm8k/test.parquet"))
"""

__version__ = "0.2.0"  # pyproject reads it; CHANGELOG.md has an entry for it

_API = ("make_config", "demo_config", "demo_profile", "plan", "train", "TrainResult", "evaluate", "generate",
        "load_model", "LoadedModel")
_OTHER = {"RLTrainer": "trainer", "Plan": "plans", "make_plan": "planner", "UserError": "errors",
          "ConfigError": "config", "PlanError": "vocabulary"}

__all__ = ["__version__", *_API, *_OTHER]


def __getattr__(name: str):
    import importlib

    if name in _API:
        return getattr(importlib.import_module(".api", __name__), name)
    if name in _OTHER:
        return getattr(importlib.import_module(f".{_OTHER[name]}", __name__), name)
    raise AttributeError(f"module 'rlanywhere' has no attribute {name!r}")
