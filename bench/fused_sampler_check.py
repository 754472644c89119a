"""The fused sampler on a GPU against exact arithmetic: greedy draws are the argmax, log-probs the tempered
log_softmax at the drawn token, draws follow the softmax (a chi-square over 20 tokens spread across Qwen2.5's
151,936-entry vocabulary), and rows sampled in parts draw what they draw whole.

    python bench/fused_sampler_check.py

Needs a CUDA GPU with Triton (rollout/fused_sampling.py). Prints one line per check.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from rlanywhere.rollout.fused_sampling import sample_into  # noqa: E402


def main() -> None:
    dev = "cuda"
    torch.manual_seed(0)
    rows, vocab = 512, 151936
    logits = torch.randn(rows, vocab, device=dev) * 3
    seed, step = torch.tensor([7], device=dev), torch.tensor([3], device=dev)
    tokens, logprobs = torch.empty(rows, dtype=torch.long, device=dev), torch.empty(rows, device=dev)
    sample_into(logits, seed, step, torch.tensor([0.0], device=dev), tokens, logprobs)
    exact = torch.log_softmax(logits.double(), -1)
    print("greedy == argmax:", torch.equal(tokens, logits.argmax(-1)), "max|lp err|",
          (logprobs.double() - exact.gather(1, tokens[:, None]).squeeze(1)).abs().max().item())
    temperature = 0.7
    sample_into(logits, seed, step, torch.tensor([temperature], device=dev), tokens, logprobs)
    exact = torch.log_softmax(logits.double() * (1 / temperature), -1)
    print("sampled: max|lp err|", (logprobs.double() - exact.gather(1, tokens[:, None]).squeeze(1)).abs().max().item(),
          "share of argmax", (tokens == logits.argmax(-1)).float().mean().item())
    # the distribution: 20 tokens spread over the vocabulary, 4096 rows x 50 steps
    probs = torch.softmax(torch.randn(20, device=dev) * 1.5, 0)
    cols = torch.randperm(vocab, device=dev)[:20]
    spread = torch.full((4096, vocab), float("-inf"), device=dev)
    spread[:, cols] = probs.log()
    drawn, drawn_lp = torch.empty(4096, dtype=torch.long, device=dev), torch.empty(4096, device=dev)
    counts = torch.zeros(20, device=dev, dtype=torch.float64)
    for s in range(50):
        sample_into(spread, seed, torch.tensor([s], device=dev), torch.tensor([1.0], device=dev), drawn, drawn_lp)
        which = (drawn[:, None] == cols).double()
        assert (which.sum(1) == 1).all(), "drew a masked token"
        counts += which.sum(0)
    n = counts.sum()
    chi2 = (((counts - n * probs.double()) ** 2) / (n * probs.double())).sum().item()
    print(f"chi-square over 20 tokens, {int(n)} draws: {chi2:.1f} (19 dof: 95% below 30.1); max rel err "
          f"{((counts / n - probs.double()).abs() / probs.double()).max().item():.3f}")
    # a row draws the same in a batch and in a part of it
    whole, part = torch.empty(rows, dtype=torch.long, device=dev), torch.empty(rows - 100, dtype=torch.long, device=dev)
    sample_into(logits, seed, step, torch.tensor([1.0], device=dev), whole, torch.empty(rows, device=dev))
    sample_into(logits[100:], seed, step, torch.tensor([1.0], device=dev), part, torch.empty(rows - 100, device=dev),
                row_offset=100)
    print("rows sampled in parts draw the same:", torch.equal(whole[100:], part))


if __name__ == "__main__":
    main()
