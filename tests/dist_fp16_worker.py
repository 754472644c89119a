"""fp16 plans sharded, on the CPU: the plan turned into fp16 autocast over fp32 weights with a GradScaler (what the
planner picks on Volta/Turing; it refuses fp16 on a CPU), and one rank's gradient made to overflow in step 2, as
an fp16 overflow in one rank's shard would (tests/test_sharding.py). Run as a script: `rlanywhere` under torchrun
with both; imported: `install(setattr)` patches this process (the one-process reference)."""

import os
import sys

import torch

from rlanywhere import trainer, update
from rlanywhere.vocabulary import FP16, Precision

OVERFLOW_STEP = 1  # trainer.global_step of the step whose gradient overflows (step 2 in the metrics)
OVERFLOW_RANK = "1"  # under torchrun; a single process (no RANK) overflows too

current_step = 0


def install(patch=setattr) -> None:
    original_init = trainer.RLTrainer.__init__
    original_train_step = trainer.RLTrainer.train_step
    original_optimizer_step = update.optimizer_step

    def init(self, cfg, plan, run_dir, notices=None):
        plan.precision, plan.compute_dtype = Precision.FP16.value, FP16
        plan.use_autocast = plan.use_grad_scaler = True
        plan.fused_optimizer = False  # as planned with a scaler
        original_init(self, cfg, plan, run_dir, notices)

    def train_step(self, items):
        global current_step
        current_step = self.global_step
        return original_train_step(self, items)

    def optimizer_step(optimizer, params, grad_clip, scaler=None):
        params = list(params)
        if current_step == OVERFLOW_STEP and os.environ.get("RANK", OVERFLOW_RANK) == OVERFLOW_RANK:
            grad = params[0].grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad  # this rank's shard
            local.view(-1)[0] = float("inf")
        return original_optimizer_step(optimizer, params, grad_clip, scaler)

    patch(trainer.RLTrainer, "__init__", init)
    patch(trainer.RLTrainer, "train_step", train_step)
    patch(update, "optimizer_step", optimizer_step)


if __name__ == "__main__":
    from rlanywhere.cli import main

    install()
    sys.exit(main(sys.argv[1:]))
