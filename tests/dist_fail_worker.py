"""`rlanywhere train` under torchrun where rank 1 raises in its second step (tests/test_distributed.py): the job
must end on every rank with that rank's message instead of hanging in a collective."""

import os
import sys

from rlanywhere import trainer
from rlanywhere.cli import main

original = trainer.RLTrainer.train_step


def failing_train_step(self, items):
    if os.environ.get("RANK") == "1" and self.global_step == 1:
        raise RuntimeError("injected failure on rank 1")
    return original(self, items)


if __name__ == "__main__":  # reward workers start from a forkserver, which imports this file again: only run here
    trainer.RLTrainer.train_step = failing_train_step
    sys.exit(main(sys.argv[1:]))
