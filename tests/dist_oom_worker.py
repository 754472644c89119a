"""`rlanywhere train` under torchrun where rank 1 runs out of memory at the start of its sharded actor update in
step 2 (trainer.global_step 1) while the micro-batch size is above 1 (tests/test_sharding.py): the job must stop with the halved size saved,
and torchrun's restart (--max-restarts) must resume from the last checkpoint at that size."""

import os
import sys

import torch

from rlanywhere import trainer, update
from rlanywhere.cli import main

current_step = 0
original_train_step = trainer.RLTrainer.train_step
original_accumulate = update.Updater.accumulate


def train_step(self, items):
    global current_step
    current_step = self.global_step
    return original_train_step(self, items)


def accumulate(self, model, optimizer, batch, rows, size, *args, **kwargs):
    if os.environ.get("RANK") == "1" and current_step == 1 and size > 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected on rank 1)")
    return original_accumulate(self, model, optimizer, batch, rows, size, *args, **kwargs)


if __name__ == "__main__":  # reward workers start from a forkserver, which imports this file again: only run here
    trainer.RLTrainer.train_step = train_step
    update.Updater.accumulate = accumulate
    sys.exit(main(sys.argv[1:]))
