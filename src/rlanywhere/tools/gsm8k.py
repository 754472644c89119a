"""verl's GSM8K tool (`verl.tools.gsm8k_tool.Gsm8kTool`), our own code with its semantics: the model submits an
answer; the tool keeps it as `#### <answer>` for the row, scores it against the row's ground truth (from
`create(ground_truth=...)` or `create_kwargs.ground_truth`) with the flexible GSM8K rule (1 right, 0 otherwise),
and returns a step reward of -0.05 when a submission does not improve on the row's best so far, else 0."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from ..rewards import gsm8k_score
from .base import BaseTool, ToolResponse, ToolSchema

NO_IMPROVEMENT_PENALTY = -0.05


class Gsm8kTool(BaseTool):
    @classmethod
    def default_schema(cls) -> ToolSchema:
        return ToolSchema("calc_gsm8k_reward", "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is "
                          "correct, 0.0 if parsed answer is incorrect or not correctly parsed)",
                          {"type": "object", "properties": {"answer": {
                              "type": "string", "description": "The model's answer to the GSM8K math problem"}},
                           "required": ["answer"]})

    def __init__(self, config: dict | None = None, tool_schema: Any = None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict] = {}
        self._lock = threading.Lock()  # rows of a batch call it from several threads

    def create(self, instance_id: str | None = None, ground_truth: str | None = None,
               **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid.uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        with self._lock:
            self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else NO_IMPROVEMENT_PENALTY
        state["reward"] = reward
        return ToolResponse(f"Current parsed answer={answer!r} reward={reward!r}"), step_reward, {}

    def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        result = gsm8k_score(state["response"], state["ground_truth"], method="flexible", format_score=0.0)
        return float(result["score"] if isinstance(result, dict) else result)

    def release(self, instance_id: str, **kwargs: Any) -> None:
        with self._lock:
            self._instances.pop(instance_id, None)


__all__ = ["Gsm8kTool", "NO_IMPROVEMENT_PENALTY"]
