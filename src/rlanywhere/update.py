"""The update mechanics: turn a StepBatch into log-probs, values and new weights, micro-batch by micro-batch.

Everything between the step's data and an optimizer step lives here: splitting rows into micro-batches (a fixed
number of rows, or a token budget), padding-free forward passes over every micro-batch (log-probs, values), the
PPO loop of epochs x mini-batches with gradient accumulated under the mini-batch's LossScale, the OOM guard around
each restartable phase, and the optimizer step (unscale, clip, non-finite handling). The losses are the actor's
(PPO clip - entropy bonus + KL loss) and the critic's (clipped value loss); the algorithms are in algorithms.py.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Optional

import torch

from . import algorithms as algo
from . import estimator as est
from .distributed import DataParallel
from .errors import UserError
from .runtime import autocast_context, training_attention_context
from .logprobs import response_logprobs
from .microbatch import PackedMicroBatch, pack_rows, response_lengths, split_rows_by_length, \
    split_rows_by_token_budget
from .models import response_values
from .offload import load_optimizer_state, offload_optimizer_state, on_device
from .sharding import call_in_root_forward, gathered, is_sharded, matched_micro_batches, needs_gradient_sum
from .oom import OOMGuard
from .prompt_sharing import MASKED, SharedPromptBatch, pack_shared_prompts, prompt_keys, split_rows_keeping_prompts
from .plans import Plan, SizeKind
from .precision_guard import PrecisionGuard, StepOutcome, logprobs_comparable, optimizer_step, rollout_logprob_gap
from .rollout_correction import RolloutCorrection
from .stepbatch import StepBatch
from .vocabulary import ACCUMULATE_DTYPE, STATISTICS_DTYPE

log = logging.getLogger(__name__)

# A loss_fn for Updater.accumulate: (model, rows, micro: PackedMicroBatch, response_mask, scale) -> (loss, shares:
# terms that add up to the mini-batch's value, means: token-mean diagnostics)
LossFn = Callable[..., tuple[torch.Tensor, dict, dict]]


class Updater:
    """Micro-batched forward passes and PPO updates for one process, sized by the plan's RuntimeSizes.

    `before_weights_change` is called right before an optimizer step may change weights (a stop signal can no
    longer drop the step); `after_optimizer_step(outcome, name)` sees each step's outcome and whose ("actor",
    "critic": the run's divergence stop)."""

    def __init__(self, plan: Plan, dp: DataParallel, oom: OOMGuard, grad_scaler, precision_guard: PrecisionGuard,
                 pad_token_id: int, response_length: int,
                 before_weights_change: Callable[[], None] = lambda: None,
                 after_optimizer_step: Callable[[StepOutcome, str], None] = lambda outcome, name: None,
                 samples_per_prompt: int = 1):
        self.plan, self.dp, self.oom, self.grad_scaler = plan, dp, oom, grad_scaler
        self.precision_guard, self.pad_token_id, self.response_length = precision_guard, pad_token_id, response_length
        self.samples_per_prompt = samples_per_prompt  # rollout.n: the rows of a shared prompt (plan.merge_...)
        self.device = plan.device
        self.before_weights_change, self.after_optimizer_step = before_weights_change, after_optimizer_step

    # ------------------------------------------------------------------------------------------ micro-batches
    def size_kind(self, fixed: SizeKind) -> SizeKind:
        """The size a phase's micro-batches follow: the token budget when there is one, else `fixed` rows."""
        return SizeKind.TOKENS_PER_MICRO_BATCH if self.uses_token_budget else fixed

    @property
    def uses_token_budget(self) -> bool:
        return self.oom.sizes.max_token_len_per_micro_batch is not None  # the run state's sizes

    def micro_batches(self, batch: StepBatch, rows: list[int], size: int) -> list[list[int]]:
        """`rows` cut into micro-batches of `size` (rows, or tokens under a token budget). With
        plan.merge_micro_batches a planned row count is a bound, not a count: a micro-batch takes more rows while
        they hold no more tokens than `size` full-length rows would (as packed rows, and with shared prompts also
        as a stream), so the planned peak holds and short responses run in fewer micro-batches. The gradient does
        not depend on the split (one LossScale per mini-batch)."""
        r = batch.rollout
        full_row = self.plan.rollout.max_seq_len  # prompt + response as planned
        merge = self.plan.merge_micro_batches and not self.uses_token_budget and bool(full_row)
        if self.plan.share_prompts:  # a prompt's rows together, so its tokens run once (prompt_sharing.py)
            keys, lens = prompt_keys(r.prompt_ids, r.prompt_mask, rows), response_lengths(r.response_mask[rows])
            # the keys each row's attention gathers stay within what packed rows of the same budget would hold
            padded = self.plan.shared_prompt_kernel == MASKED
            if merge:
                stream = est.shared_stream_tokens(size, self.samples_per_prompt, full_row - self.response_length,
                                                  self.response_length)
                groups = split_rows_keeping_prompts(keys, lens, stream, by_tokens=True, row_tokens=size * full_row,
                                                    padded=padded)
            elif self.uses_token_budget:
                groups = split_rows_keeping_prompts(keys, lens, size, by_tokens=True, row_tokens=size, padded=padded)
            else:
                groups = split_rows_keeping_prompts(keys, lens, size)
        elif self.uses_token_budget or merge:
            groups = split_rows_by_token_budget(r.prompt_mask[rows], r.response_mask[rows], size * full_row if merge
                                                else size, packed=True)  # costed as forward_rows builds them
        else:  # rows of similar length share a micro-batch: less padding, same gradient (one LossScale per mini-batch)
            groups = split_rows_by_length(r.prompt_mask[rows], r.response_mask[rows], size)
        return [[rows[i] for i in group] for group in groups]

    def forward_rows(self, batch: StepBatch, rows: list[int]) -> PackedMicroBatch | SharedPromptBatch:
        """A micro-batch on the device: one token stream with each distinct prompt once (plan.share_prompts,
        prompt_sharing.py), else each row's tokens from column 0 (microbatch.pack_rows: no attention mask, padding
        only after the longest row)."""
        r = batch.rollout
        if self.plan.share_prompts:
            return pack_shared_prompts(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask, rows,
                                       self.pad_token_id, self.plan.micro_batch_width_multiple,
                                       self.plan.shared_prompt_kernel).to(self.device)
        packed = pack_rows(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask, rows, self.pad_token_id,
                           self.plan.micro_batch_width_multiple)
        return PackedMicroBatch(*(to_device(t, self.device) if torch.is_tensor(t) else t for t in packed))

    # ------------------------------------------------------------------------------------------ forward passes
    @torch.no_grad()
    def forward_all(self, phase: str, batch: StepBatch, compute: Callable, guarded: bool = True) -> torch.Tensor:
        """compute(micro: PackedMicroBatch) -> [rows, response_len] over every micro-batch, gathered into a [rows, R]
        CPU tensor (0 at padding); micro-batched by the plan, OOM-guarded (`guarded=False`: run once at the
        current size, an out-of-memory error raised to the caller)."""

        def run(size: int) -> torch.Tensor:
            # gathered on the device and copied to the host once: a .cpu() per micro-batch would idle the GPU
            # while the host prepares the next one
            out = torch.zeros(batch.mask.shape, dtype=ACCUMULATE_DTYPE, device=self.device)
            with training_passes(self.plan):
                for rows in self.micro_batches(batch, list(range(batch.rows)), size):
                    micro = self.forward_rows(batch, rows)
                    with autocast_context(self.plan):
                        values = compute(micro).float()
                    out[to_device(torch.tensor(rows), self.device), :micro.response_len] = values
            return out.cpu() * batch.rollout.response_mask  # every response: a loss mask only narrows the losses

        kind = self.size_kind(SizeKind.LOGPROB_MICRO_BATCH)
        return self.oom.run(phase, run, kind) if guarded else run(self.oom.sizes.get(kind))

    def logprobs(self, model, batch: StepBatch, temperature: float, guarded: bool = True) -> torch.Tensor:
        """Log-probs of every response token under `model` (`guarded`: as forward_all's)."""
        logprobs = call_in_root_forward(model, response_logprobs)  # [distributed] sharded: in the root's forward
        with gathered(model):  # [distributed] sharded: full weights for the pass, so ranks need not match calls
            return self.forward_all("log_probs", batch, lambda micro: micro_logprobs(
                logprobs, model, micro, temperature, self.plan.logprob_chunk_size, self.plan.compile_training)[0],
                guarded=guarded)

    def values(self, critic, batch: StepBatch) -> torch.Tensor:
        with gathered(critic):  # [distributed] sharded: full weights for the pass
            return self.forward_all("values", batch, lambda micro: micro_values(critic, micro))

    # ------------------------------------------------------------------------------------------ updates
    def accumulate(self, model, optimizer, batch: StepBatch, rows: list[int], size: int, loss_fn: LossFn,
                   scale: Optional[algo.LossScale] = None) -> dict:
        """One optimizer step's gradient over `rows`, accumulated over micro-batches of `size`.

        The mini-batch's denominators (tokens, sequences, T) are fixed once, before the split, and every
        micro-batch loss is its exact share of the mini-batch loss: the gradient does not depend on the
        micro-batch size, the token budget or OOM halving, for every loss_agg_mode. Under data parallelism `scale`
        holds the counts of all ranks' rows (DataParallel.loss_scale)."""
        optimizer.zero_grad(set_to_none=True)
        if scale is None:
            scale = algo.LossScale.of(batch.mask[rows], norm_length=self.response_length)
        # metrics stay on the device until the mini-batch ends: one host wait per optimizer step, not per micro-batch
        totals: dict[str, torch.Tensor | float] = {}
        losses: list[tuple[list[int], torch.Tensor]] = []
        # [distributed] a sharded model: as many backward passes on every rank (padding ones weigh 0)
        # the planned SDPA backends for forward and backward alike (checkpointing recomputes attention in backward)
        with training_passes(self.plan):
            # a rank whose share of this mini-batch is empty pads with its batch's first row
            for micro, padding in matched_micro_batches(self.micro_batches(batch, rows, size), self.dp,
                                                        is_sharded(model), fallback=[0]):
                inputs = self.forward_rows(batch, micro)
                host_mask = batch.mask[micro, :inputs.response_len]
                resp_mask = to_device(host_mask, self.device)
                if padding:  # the model's passes without the loss: a loss that is not finite can add no NaN
                    with autocast_context(self.plan):
                        zero, _, _ = loss_fn(model, micro, inputs, resp_mask, scale, padding=True)
                    zero.backward()
                    continue
                with autocast_context(self.plan):
                    loss, shares, means = loss_fn(model, micro, inputs, resp_mask, scale)
                losses.append((micro, loss.detach()))
                (self.grad_scaler.scale(loss) if self.grad_scaler else loss).backward()
                # loss terms add up to the mini-batch's value; diagnostics (token means) are weighted by tokens
                token_share = float(host_mask.sum()) / max(scale.tokens, 1.0)
                for key, value in shares.items():
                    totals[key] = totals.get(key, 0.0) + _detached(value)
                for key, value in means.items():
                    totals[key] = totals.get(key, 0.0) + _detached(value) * token_share
        if losses:
            finite = torch.isfinite(torch.stack([loss for _, loss in losses])).tolist()
            for (micro, loss), ok in zip(losses, finite):
                if not ok:  # say which rows, so a rare NaN can be traced to its data
                    log.warning("non-finite loss %s in a micro-batch of rows %s (response lengths %s, prompt "
                                "lengths %s)", float(loss), micro[:16], batch.mask[micro].sum(-1).int().tolist()[:16],
                                batch.rollout.prompt_mask[micro].sum(-1).tolist()[:16])
        return {key: float(value) for key, value in totals.items()}

    def optimizer_step(self, name: str, model, optimizer, grad_clip: float) -> float:
        """Unscale, clip, step (see precision_guard.optimizer_step); returns the grad norm. A step skipped by the
        fp16 loss scaler is normal (counted, logged as */skipped_steps); a non-finite norm skips the step."""
        self.before_weights_change()
        outcome = optimizer_step(optimizer, [p for p in model.parameters() if p.requires_grad], grad_clip,
                                 self.grad_scaler)
        self.precision_guard.record(name, outcome)
        if outcome.nonfinite_failure:
            bad = [param for param, p in model.named_parameters()
                   if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            log.warning("non-finite grad norm %.3g: skipping this optimizer step (%d parameter tensors non-finite, "
                        "first: %s)", outcome.grad_norm, len(bad), ", ".join(bad[:4]))
        self.after_optimizer_step(outcome, name)
        optimizer.zero_grad(set_to_none=True)
        return outcome.grad_norm

    def ppo_update(self, name: str, model, optimizer, batch: StepBatch, loss_fn: LossFn, *, mini_rows: int,
                   epochs: int, shuffle_seed: Optional[int], grad_clip: float, kind: SizeKind,
                   park: Optional[torch.nn.Module] = None, norm_length: float | None = None) -> dict:
        """`epochs` passes over the batch in mini-batches of `mini_rows` rows (all ranks' rows), one optimizer step
        each (rows shuffled per epoch when `shuffle_seed` is given); metrics averaged over the steps as
        `name/<metric>`. With param offload, `park` (the model not being trained) leaves the GPU meanwhile.
        norm_length: the constant of seq-mean-token-sum-norm (verl's loss_scale_factor; None: the response length)."""
        norm_length = norm_length or self.response_length
        # [distributed] a sharded model parks itself (FSDP2's CPUOffloadPolicy)
        parked = on_device(park, "cpu") if park is not None and self.plan.param_offload and self.device != "cpu" \
            and not is_sharded(park) else contextlib.nullcontext()
        with parked:
            if self.plan.optimizer_offload:
                load_optimizer_state(optimizer, self.device)
            model.train()
            local: dict[str, float] = {}  # this rank's metric sums over the optimizer steps
            grad_norms, count = 0.0, 0
            for epoch in range(epochs):
                order = list(range(batch.rows))
                if shuffle_seed is not None:
                    order = torch.randperm(batch.rows, generator=torch.Generator().manual_seed(shuffle_seed + epoch))
                    order = order.tolist()
                # [distributed] mini_rows counts all ranks' rows: as many optimizer steps on every rank, each over
                # its share; the loss denominators and the gradient are summed over ranks
                steps = -(-(self.dp.layout.total if self.dp.enabled else batch.rows) // mini_rows)
                local_mini = -(-batch.rows // max(steps, 1)) if self.dp.enabled else mini_rows
                minis = [order[start:start + local_mini] for start in range(0, steps * local_mini, local_mini)]
                # [distributed] every mini-batch's loss denominators in one exchange before the first of them
                scales = self.dp.loss_scales([batch.mask[rows] for rows in minis], norm_length)
                for rows, scale in zip(minis, scales):
                    accumulate = lambda size, rows=rows, scale=scale: self.accumulate(  # noqa: E731
                        model, optimizer, batch, rows, size, loss_fn, scale)
                    # [distributed] a sharded update communicates per layer: one rank redoing a micro-batch alone
                    # would pair its collectives with other ones, so an OOM there ends the job, which relaunches
                    # at the halved size (oom.py)
                    guarded = self.oom.run_matched if is_sharded(model) else self.oom.run
                    metrics = guarded(f"{name}_update", accumulate, self.size_kind(kind))
                    if needs_gradient_sum(model):  # [distributed] FSDP2 reduce-scatters a sharded model's itself
                        self.dp.sum_gradients(model)
                    grad_norms += self.optimizer_step(name, model, optimizer, grad_clip)
                    for key, value in metrics.items():
                        local[key] = local.get(key, 0.0) + value
                    count += 1
            totals = self.dp.sum_dict(local)  # [distributed] summed over ranks once per update, not once per step
            totals["grad_norm"] = grad_norms  # the same on every rank: the norm of the summed gradient
            model.eval()
            if self.plan.optimizer_offload:
                offload_optimizer_state(optimizer, "cpu")
        return {f"{name}/{k}": v / max(count, 1) for k, v in totals.items()}


class CompiledPassError(UserError, RuntimeError):
    """The compiled training passes (plan.compile_training) could not be compiled on this machine."""


@contextlib.contextmanager
def training_passes(plan: Plan):
    """Around every training-side forward/backward: the planned SDPA backends, and a compile failure of the
    compiled passes (the first call compiles) named with its fix instead of a compiler traceback."""
    with training_attention_context(plan):
        if not plan.compile_training:
            yield
            return
        try:
            yield
        except torch._dynamo.exc.TorchDynamoException as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CompiledPassError(
                f"the compiled training passes failed to compile here ({type(exc).__name__}: {first_line}); run "
                "with actor_rollout_ref.actor.use_torch_compile=false for eager passes (slower updates, same "
                "results), and check `rlanywhere doctor`") from exc


def micro_logprobs(logprobs_fn, model, micro: PackedMicroBatch | SharedPromptBatch, temperature: float,
                   chunk_size: int, compiled_head: bool, with_entropy: bool = False):
    """`logprobs_fn` (response_logprobs, or its sharded wrapper) over a micro-batch's response tokens: (log-probs,
    entropy or None), each [rows, response_len]. Rollout tokens need no label check (a host wait on a GPU)."""
    if isinstance(micro, SharedPromptBatch):
        return logprobs_fn(model, None, None, micro.response_len, temperature=temperature, chunk_size=chunk_size,
                           with_entropy=with_entropy, check_labels=not micro.input_ids.is_cuda,
                           compiled_head=compiled_head, shared=micro)
    return logprobs_fn(model, micro.input_ids, micro.attention_mask, micro.response_len, temperature=temperature,
                       chunk_size=chunk_size, with_entropy=with_entropy, position_ids=micro.position_ids,
                       check_labels=not micro.input_ids.is_cuda, compiled_head=compiled_head,
                       response_start=micro.response_start)


def micro_values(critic, micro: PackedMicroBatch | SharedPromptBatch) -> torch.Tensor:
    """The critic's values of a micro-batch's response tokens [rows, response_len]."""
    if isinstance(micro, SharedPromptBatch):
        return response_values(critic, None, None, micro.response_len, shared=micro)
    return response_values(critic, micro.input_ids, micro.attention_mask, micro.response_len, micro.position_ids,
                           response_start=micro.response_start)


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A host tensor copied to `device` without waiting for the GPU's queued work: a plain `.to(device)` syncs the
    stream, which idled the GPU once per copy (several per micro-batch). From pageable memory CUDA stages the bytes
    before returning, so the host tensor may be freed at once."""
    return tensor.to(device, non_blocking=True)


def _detached(value):
    """A metric term kept on its device, summed in float64 as Python floats were."""
    return value.detach().to(STATISTICS_DTYPE) if torch.is_tensor(value) else value


# ---------------------------------------------------------------------------------------------- the losses
def critic_loss(batch: StepBatch, critic_cfg, device: str) -> LossFn:
    """The critic's loss_fn: clipped value loss against the batch's returns."""

    def loss_fn(model, rows, micro, resp_mask, scale, padding=False):
        pick = lambda t: to_device(t[rows, :micro.response_len], device)  # noqa: E731
        values = micro_values(model, micro)
        if padding:  # [distributed] a padding pass: zero weight on the model's outputs, never on the batch's data
            return values.sum() * 0.0, {}, {}
        loss, metrics = algo.value_loss(values, pick(batch.values), pick(batch.returns), resp_mask,
                                        critic_cfg.cliprange_value, critic_cfg.loss_agg_mode, scale)
        return loss, {"vf_loss": loss.detach()}, metrics

    return loss_fn


def actor_loss(batch: StepBatch, actor_cfg, rollout_cfg, logprob_chunk_size: int, device: str,
               compiled_head: bool = False, correction: Optional[RolloutCorrection] = None,
               several_optimizer_steps: bool = False) -> LossFn:
    """The actor's loss_fn: PPO clip (or GSPO) - entropy bonus + KL loss, one aggregation mode. compiled_head:
    the log-prob head's chunk math compiled (plan.compile_training). correction: the rollout correction
    (rollout_correction.py): importance weights between the rollout's and the trainer's policies.
    several_optimizer_steps: the update takes more than one, so the policy moves between its micro-batches."""
    correction = correction or RolloutCorrection()
    temperature = rollout_cfg.temperature or 1.0
    clip_low = actor_cfg.clip_ratio_low if actor_cfg.clip_ratio_low is not None else actor_cfg.clip_ratio
    clip_high = actor_cfg.clip_ratio_high if actor_cfg.clip_ratio_high is not None else actor_cfg.clip_ratio
    mode = actor_cfg.loss_agg_mode
    policy_loss = algo.POLICY_LOSSES[actor_cfg.policy_loss.loss_mode]  # vanilla PPO clip or GSPO
    sequence_metrics = (*algo.SEQUENCE_METRICS[actor_cfg.policy_loss.loss_mode], *correction.sequence_metrics)
    compare_rollout = logprobs_comparable(rollout_cfg.top_k, rollout_cfg.top_p)

    def loss_fn(model, rows, micro, resp_mask, scale, padding=False):
        # [distributed] call_in_root_forward: a sharded model's root weights gathered around the head
        logprob, entropy = micro_logprobs(call_in_root_forward(model, response_logprobs), model, micro, temperature,
                                          logprob_chunk_size, compiled_head, with_entropy=True)
        if padding:  # [distributed] a padding pass: zero weight on the model's outputs, never on the batch's data
            return logprob.sum() * 0.0, {}, {}
        pick = lambda t: to_device(t[rows, :micro.response_len], device)  # noqa: E731
        rollout_logprobs = pick(batch.rollout.response_logprobs)
        # the trainer's policy before this update (a single update's own forward gives it); in bypass mode the
        # current policy, which the logged weights compare with the rollout's, as verl's bypass mode does
        trainer_old = pick(batch.old_logprobs) if batch.old_logprobs is not None and not correction.bypass_mode \
            else logprob.detach()
        is_weights, correction_means = correction.weights(trainer_old, rollout_logprobs, resp_mask)
        old = correction.behaviour(trainer_old, rollout_logprobs)
        # means: pg_clipfrac, approx_kl, ratio statistics (algorithms.POLICY_LOSSES)
        pg_loss, means = policy_loss(old, logprob, pick(batch.advantages), resp_mask, clip_low, clip_high,
                                     actor_cfg.clip_ratio_c, mode, scale, token_weights=is_weights)
        means.update(correction_means)
        # without an entropy bonus the entropy is a metric only: detached, so backward skips its softmax math
        bonus = bool(actor_cfg.entropy_coeff)
        ent = algo.entropy_loss(entropy if bonus else entropy.detach(), resp_mask, mode, scale)
        loss = pg_loss - actor_cfg.entropy_coeff * ent if bonus else pg_loss
        shares = {"pg_loss": pg_loss.detach(), "entropy": ent.detach()}
        # means over this micro-batch's sequences: its share of the mini-batch's sequences, as losses are shares
        sequences = (resp_mask.sum(-1) > 0).sum() / max(scale.sequences, 1.0)
        shares.update({key: means.pop(key) * sequences for key in sequence_metrics if key in means})
        # trainer vs rollout log-probs of the behaviour policy (precision_guard). In bypass mode the trainer's pi_old
        # is the current policy only while no optimizer step has moved it: with several, the gap would be the
        # update's own moves, not the precision's
        if compare_rollout and not (correction.bypass_mode and several_optimizer_steps):
            means["rollout_logprob_gap"] = rollout_logprob_gap(trainer_old, rollout_logprobs, resp_mask)
        if actor_cfg.use_kl_loss and batch.ref_logprobs is not None:
            kl = algo.kl_loss(logprob, pick(batch.ref_logprobs), resp_mask, actor_cfg.kl_loss_type, mode, scale)
            loss = loss + actor_cfg.kl_loss_coef * kl
            shares["kl_loss"] = kl.detach()
        return loss, shares, means

    return loss_fn
