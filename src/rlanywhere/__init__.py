"""rlanywhere: RL post-training of LLMs that plans itself around the hardware you have."""

__version__ = "0.1.0"
