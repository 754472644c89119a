"""Learned reward models: a discriminative reward model (a sequence classifier scoring prompt + response) and a
generative judge (a causal LM asked to grade, its verdict parsed), planned into memory like the other models.

* :class:`DiscriminativeRewardModel` — an ``AutoModelForSequenceClassification`` with its own tokenizer. As verl
  does, the policy's response text is put back into the conversation (``raw_prompt`` + an assistant turn) and
  rendered with the reward model's own chat template, then tokenized with its tokenizer (no special tokens added
  twice), cut to ``max_length`` (verl's ``truncation``: right keeps the first tokens), right-padded by us whatever
  the tokenizer's ``padding_side``, and scored in micro-batches (a row count, or a token budget with
  ``use_dynamic_bsz``). The score is the classifier head applied to the hidden state of each row's last real token
  (not HF's pad-token search, which fails when the pad token is also the EOS the template ends with).
* :class:`GenerativeJudge` — a causal LM; each response is put into a grading prompt
  (``reward_model.judge.prompt_template`` with ``{prompt}``, ``{response}``, ``{ground_truth}``), rendered with the
  judge's chat template, generated greedily and short with the built-in rollout engine, and its verdict parsed by a
  user function (``judge.verdict_function.path/name``: text -> float or None) or a regex (``judge.verdict_regex``:
  its first group a number). A verdict that cannot be parsed scores ``judge.failure_score`` and is counted; it
  never stops the run.
* :class:`ModelRewardManager` — the reward function interface of ``rewards.RewardManager`` with a model in it.
  verl's semantics: without ``custom_reward_function`` the reward is the model score; with one, the user function
  is called as usual and finds the model score in ``extra_info["rm_score"]`` (the judge's text in
  ``extra_info["judge_response"]``) and returns the combined reward (e.g. the score plus a format bonus). The
  rule for the row's ``data_source``, where one is registered, still fills ``acc`` / ``format`` for the metrics.
  Per step it reports the score mean / std, parse failures and scoring time (``info["rm_*"]``).
* :func:`plan_reward_model` — the planner's decision, a pure function of the policy's memory estimate: the reward
  model's dtype (the rollout's: the card's inference precision) and attention (the actor's), its micro-batch, a
  "reward" phase added to the estimate, and whether it waits in CPU memory between scorings (it is moved to the
  GPU for the scoring phase only) when the training phases do not fit beside it. A scoring phase that cannot fit
  even so is refused before anything loads, with both estimates.

The reward model is never trained and never saved in checkpoints; its path is in the run's config and plan.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

import torch

from .errors import UserError
from .planner.reward_model import (DISCRIMINATIVE, GENERATIVE, RewardModelPlan, plan_from_config,  # noqa: F401
                                   plan_reward_model, reward_model_kind, reward_model_scoring_bytes,
                                   reward_model_weight_bytes, rm_micro_batch_request)
from .vocabulary import ATTN_IMPLEMENTATIONS, ATTN_SDPA, FP32, STATISTICS_DTYPE, dtype_from_name

log = logging.getLogger(__name__)

TRUNCATIONS = ("right", "left", "error")
# Tokens a judge may generate unless told otherwise: enough for "Score: 7" or "[[yes]]" and a few words before it.
DEFAULT_JUDGE_TOKENS = 16
DEFAULT_JUDGE_TEMPLATE = ("Grade the answer to the question. Reply with only a score from 0 to 10.\n\n"
                          "Question: {prompt}\n\nAnswer: {response}\n\nScore:")
DEFAULT_VERDICT_REGEX = r"\A\D*?(-?\d+(?:\.\d+)?)"  # the reply's first number: "7/10" is 7


# ------------------------------------------------------------------------------------------------- config
def reward_model_config_problem(cfg) -> Optional[str]:
    """Value checks of reward_model.* before anything loads: what is wrong, naming the key and the fix; None if
    nothing is (config.py raises it as a ConfigError)."""
    rm = cfg.reward_model
    if not rm.enable:
        return None
    if not rm.model.path:
        return ("reward_model.enable=true needs reward_model.model.path: a sequence-classification reward "
                "model (directory or hub id), or a causal LM with reward_model.judge.enable=true")
    for key in ("micro_batch_size_per_gpu", "micro_batch_size", "max_length", "forward_max_token_len_per_gpu"):
        value = getattr(rm, key)
        if value is not None and int(value) <= 0:
            return (f"reward_model.{key} must be positive (or null: planned), got {value}")
    if rm.truncation not in TRUNCATIONS:
        return (f"reward_model.truncation={rm.truncation!r} is not valid; choose one of {', '.join(TRUNCATIONS)}")
    offload = rm.model.fsdp_config.param_offload
    if offload not in (True, False, "auto"):
        return (f"reward_model.model.fsdp_config.param_offload={offload!r}: use true, false or auto")
    judge = rm.judge
    if judge.enable:
        if judge.max_new_tokens <= 0:
            return (f"reward_model.judge.max_new_tokens must be positive, got {judge.max_new_tokens}")
        if "{response}" not in judge.prompt_template:
            return ("reward_model.judge.prompt_template has no {response} field: the judge would never see "
                            "the answer it grades; add {response} (and {prompt}, {ground_truth} if you like)")
        try:
            judge.prompt_template.format(prompt="", response="", ground_truth="")
        except (KeyError, IndexError, ValueError) as exc:
            return (f"reward_model.judge.prompt_template cannot be filled in ({type(exc).__name__}: {exc}): its "
                    "fields are {prompt}, {response} and {ground_truth}; write any other brace twice ({{ and }}), "
                    'e.g. a JSON example as {{"score": 7}}')
        if not judge.verdict_function.path:
            try:
                pattern = re.compile(judge.verdict_regex)
            except re.error as exc:
                return f"reward_model.judge.verdict_regex {judge.verdict_regex!r} is not a regex: {exc}"
            if pattern.groups < 1:
                return ("reward_model.judge.verdict_regex needs one group around the number, e.g. "
                        r"'Score: (\d+)'")
    return None


def rows_need_answers(cfg) -> bool:
    """Whether every data row needs reward_model.ground_truth: a rule scores it, or a judge's template shows it
    ({ground_truth}); a reward model alone scores without (verl's naive manager)."""
    rm = cfg.reward_model
    return not rm.enable or (bool(rm.judge.enable) and "{ground_truth}" in str(rm.judge.prompt_template))


# -------------------------------------------------------------------------------------------- re-templating
def conversation(prompt: Any, response: str) -> list[dict]:
    """The prompt's messages (a chat list, or a plain string as one user turn) and the response as the
    assistant's turn."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in list(prompt)]
    return messages + [{"role": "assistant", "content": response}]


def render_for_reward_model(tokenizer, prompt: Any, response: str) -> str:
    """verl's chat-template switch: the conversation in the reward model's own template (no generation prompt);
    a tokenizer without a template gets prompt and response joined by a newline."""
    messages = conversation(prompt, response)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    return "\n".join(m["content"] for m in messages)


def truncate(ids: list[int], max_length: Optional[int], side: str = "right") -> list[int]:
    """At most max_length ids: 'right' keeps the first (verl's default), 'left' the last, 'error' raises."""
    if not max_length or len(ids) <= max_length:
        return list(ids)
    if side == "error":
        raise UserError(f"a reward-model input has {len(ids)} tokens > reward_model.max_length={max_length}; raise "
                        "it or set reward_model.truncation=right|left")
    return list(ids[:max_length]) if side == "right" else list(ids[-max_length:])


def right_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [len(rows), widest], each row from column 0 and padded after."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids, mask


def token_budget_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices in micro-batches of at most max_tokens padded tokens (rows x the longest), longest first:
    similar lengths share a batch (verl's use_dynamic_bsz). A row longer than the budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def fixed_batches(count: int, size: int) -> list[list[int]]:
    return [list(range(start, min(start + size, count))) for start in range(0, count, max(size, 1))]


# ---------------------------------------------------------------------------------------------- the models
class _OffloadableModel:
    """A frozen model that waits on `home` and visits `device` while it scores (when offloaded)."""

    model: torch.nn.Module
    device: str
    offload: bool

    def _home(self) -> str:
        return "cpu" if self.offload else self.device

    def to_device(self) -> None:
        self.model.to(self.device)

    def to_home(self) -> None:
        self.model.to(self._home())
        if self.offload and str(self.device).startswith("cuda"):
            torch.cuda.empty_cache()

    def where(self) -> str:
        return str(next(self.model.parameters()).device)


class DiscriminativeRewardModel(_OffloadableModel):
    """Scores (prompt, response) pairs with a sequence classifier; see the module docstring."""

    kind = DISCRIMINATIVE

    def __init__(self, model, tokenizer, device: str = "cpu", micro_batch: int = 8, max_length: Optional[int] = None,
                 max_token_len: Optional[int] = None, truncation: str = "right", offload: bool = False):
        self.model, self.tokenizer = model.eval().requires_grad_(False), tokenizer
        self.device, self.micro_batch, self.max_length = device, int(micro_batch), max_length
        self.max_token_len, self.truncation, self.offload = max_token_len, truncation, offload
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.model.to(self._home())

    def encode(self, prompts: Sequence[Any], responses: Sequence[str]) -> list[list[int]]:
        """Re-templated, tokenized (special tokens come from the template only) and truncated ids per row."""
        texts = [render_for_reward_model(self.tokenizer, p, r) for p, r in zip(prompts, responses)]
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [truncate(ids, self.max_length, self.truncation) or [self.pad_id] for ids in encoded]

    @torch.no_grad()
    def forward_ids(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Scores [len(rows)] float32 on the CPU for one micro-batch: the head on each row's last real token."""
        return self.row_scores(rows).cpu()

    def row_scores(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """forward_ids on the model's device, differentiable (to fit a reward model, as a bench does). A decoder
        classifier (its head `score`, verl's reward models) scores each row's last real token through its backbone;
        any other model (encoders: BERT, RoBERTa, DeBERTa pool or read the first token in their own way) through
        its own forward."""
        ids, mask = right_padded(rows, self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        if not isinstance(getattr(self.model, "score", None), torch.nn.Module):
            return self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)[0]
        last = hidden[torch.arange(len(rows), device=hidden.device), mask.sum(-1) - 1]
        return self.model.score(last)[:, 0].float()

    def score(self, prompts: Sequence[Any], responses: Sequence[str]) -> tuple[torch.Tensor, dict]:
        rows = self.encode(prompts, responses)
        lengths = [len(r) for r in rows]
        batches = (token_budget_batches(lengths, self.max_token_len) if self.max_token_len
                   else fixed_batches(len(rows), self.micro_batch))
        scores = torch.zeros(len(rows), dtype=FP32)
        for batch in batches:
            scores[batch] = self.forward_ids([rows[i] for i in batch])
        return scores, {}


def parse_verdict(text: str, pattern: "re.Pattern[str]") -> Optional[float]:
    """The first group of the last match of `pattern` in `text` as a finite float, or None."""
    matches = list(pattern.finditer(text))
    if not matches:
        return None
    try:
        value = float(matches[-1].group(1))
    except (TypeError, ValueError, IndexError):
        return None
    return value if math.isfinite(value) else None


class GenerativeJudge(_OffloadableModel):
    """Grades responses with a causal LM: template -> greedy, short generation -> parsed verdict."""

    kind = GENERATIVE

    def __init__(self, model, tokenizer, device: str = "cpu", micro_batch: int = 8, max_length: Optional[int] = None,
                 prompt_template: str = DEFAULT_JUDGE_TEMPLATE, verdict_regex: str = DEFAULT_VERDICT_REGEX,
                 verdict_fn: Optional[Callable[[str], Any]] = None, max_new_tokens: int = DEFAULT_JUDGE_TOKENS,
                 failure_score: float = 0.0, offload: bool = False, engine_plan: Any = None):
        from .rollout import make_engine

        self.model, self.tokenizer = model.eval().requires_grad_(False), tokenizer
        self.device, self.micro_batch, self.max_length, self.offload = device, int(micro_batch), max_length, offload
        self.prompt_template, self.verdict_fn = prompt_template, verdict_fn
        self.pattern = re.compile(verdict_regex)
        self.max_new_tokens, self.failure_score = int(max_new_tokens), float(failure_score)
        self.model.to(self._home())
        self.engine = make_engine(self.model, tokenizer, engine_plan)

    def grading_prompt(self, prompt: Any, response: str, ground_truth: Any = "") -> list[int]:
        question = prompt if isinstance(prompt, str) else "\n".join(str(m["content"]) for m in prompt
                                                                    if m["role"] != "system")
        text = self.prompt_template.format(prompt=question, response=response, ground_truth=ground_truth)
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return truncate(list(ids), self.max_length, "left")  # the end (the answer, "Score:") matters most

    def verdict(self, text: str) -> Optional[float]:
        if self.verdict_fn is None:
            return parse_verdict(text, self.pattern)
        try:
            value = self.verdict_fn(text)
            return None if value is None or not math.isfinite(float(value)) else float(value)
        except (Exception, SystemExit):  # noqa: BLE001 - a user parser may raise anything: a parse failure
            return None

    @torch.no_grad()
    def score(self, prompts: Sequence[Any], responses: Sequence[str],
              ground_truths: Optional[Sequence[Any]] = None) -> tuple[torch.Tensor, dict]:
        from .rollout.base import SamplingParams

        truths = list(ground_truths) if ground_truths is not None else [""] * len(responses)
        inputs = [self.grading_prompt(p, r, g) for p, r, g in zip(prompts, responses, truths)]
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0, n=1)
        rollout = self.engine.generate(inputs, params, rows_per_wave=self.micro_batch).to("cpu")
        texts = rollout.decode(self.tokenizer)
        verdicts = [self.verdict(t) for t in texts]
        failures = sum(v is None for v in verdicts)
        scores = torch.tensor([self.failure_score if v is None else v for v in verdicts], dtype=FP32)
        return scores, {"judge_response": texts, "rm_parse_failures": failures}


# ------------------------------------------------------------------------------------------ reward manager
class ModelRewardManager:
    """RewardManager's interface with a reward model: see the module docstring for how scores combine."""

    needs_prompts = True  # RolloutPhase passes the prompts' messages (prompts=...)

    def __init__(self, scorer, rules, combine_with_custom: bool):
        self.scorer, self.rules, self.combine = scorer, rules, combine_with_custom
        self.last_error = None
        self.warned_nonfinite = False

    @property
    def num_errors(self) -> int:
        return getattr(self.rules, "num_errors", 0)

    def close(self) -> None:
        self.rules.close()

    def model_scores(self, prompts, responses, ground_truths) -> tuple[torch.Tensor, dict]:
        start = time.perf_counter()
        self.scorer.to_device()
        try:
            if self.scorer.kind == GENERATIVE:
                scores, extra = self.scorer.score(prompts, responses, ground_truths)
            else:
                scores, extra = self.scorer.score(prompts, responses)
        finally:
            self.scorer.to_home()
        extra["rm_time_s"] = time.perf_counter() - start
        finite = torch.isfinite(scores)
        extra["rm_nonfinite"] = int((~finite).sum())  # in every batch's info: joined batches add them up
        if extra["rm_nonfinite"]:  # e.g. an overflow in half precision: scored 0 and counted, as a rule's NaN is
            if not self.warned_nonfinite:
                self.warned_nonfinite = True
                log.warning("the reward model gave %d non-finite scores (NaN or inf) in a batch of %d: they score 0 "
                            "and count in reward/errors (said once)", extra["rm_nonfinite"], len(scores))
            scores = torch.where(finite, scores, torch.zeros_like(scores))
        return scores, extra

    def __call__(self, responses: list[str], ground_truths: list[Any], data_sources: list[str],
                 extra_infos: Optional[list[dict]] = None, prompts: Optional[list[Any]] = None):
        if prompts is None:
            raise ValueError("a reward model scores prompt and response: pass prompts= (the prompts' messages)")
        model, extra = self.model_scores(prompts, responses, ground_truths)
        judged = extra.pop("judge_response", None)
        infos = []
        for i, info in enumerate(extra_infos or [None] * len(responses)):
            info = dict(info or {})
            info["rm_score"] = float(model[i])
            if judged is not None:
                info["judge_response"] = judged[i]
            infos.append(info)
        if self.combine:  # the user's function decides the reward, the model score in extra_info["rm_score"]
            scores, info = self.rules(responses, ground_truths, data_sources, infos)
        else:  # verl: the model score is the reward; a registered rule still reports acc / format
            _, info = self._rule_metrics(responses, ground_truths, data_sources, infos)
            scores = model.clone()
        self.last_error = self.rules.last_error
        info["rm_score"] = model.tolist()
        info.update(extra)
        info["num_errors"] = info.get("num_errors", 0) + extra["rm_nonfinite"]
        info.setdefault("rm_parse_failures", 0)
        return scores.float(), info

    def _rule_metrics(self, responses, ground_truths, data_sources, infos):
        from .rewards import REWARD_FUNCTIONS

        if all(source in REWARD_FUNCTIONS for source in data_sources):
            return self.rules(responses, ground_truths, data_sources, infos)
        zeros = [0.0] * len(responses)
        return torch.zeros(len(responses)), {"acc": list(zeros), "format": list(zeros), "num_errors": 0,
                                             "acc_returned": 0}


def reward_model_metrics(infos: Sequence[dict]) -> dict:
    """Step metrics from the reward info of every rank: score mean/std, judge parse failures, scoring time."""
    scores = [s for info in infos for s in info.get("rm_score", [])]
    if not scores:
        return {}
    values = torch.tensor(scores, dtype=STATISTICS_DTYPE)
    return {"reward_model/score_mean": float(values.mean()),
            "reward_model/score_std": float(values.std()) if len(scores) > 1 else 0.0,
            "reward_model/parse_failures": float(sum(info.get("rm_parse_failures", 0) for info in infos)),
            "timing/reward_model": max(float(info.get("rm_time_s", 0.0)) for info in infos)}


# ------------------------------------------------------------------------------------------------ building
def _load_verdict_fn(judge_cfg) -> Optional[Callable]:
    if not judge_cfg.verdict_function.path:
        return None
    from .rewards import load_custom_reward

    return load_custom_reward(judge_cfg.verdict_function.path, judge_cfg.verdict_function.name)


def build_scorer(cfg, plan, rm_plan: Optional[RewardModelPlan] = None):
    """Load the reward model the config names, as planned (dtype, attention, device, offload)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from .models import load_tokenizer, resolve_model_source

    rm = cfg.reward_model
    rm_plan = rm_plan or getattr(plan, "reward_model", None)
    if isinstance(rm_plan, dict):
        rm_plan = RewardModelPlan(**rm_plan)
    kind = reward_model_kind(rm)
    dtype = dtype_from_name(rm_plan.dtype) if rm_plan else plan.rollout.dtype
    attn = rm_plan.attn_implementation if rm_plan else plan.attn_implementation
    attn = attn if attn in ATTN_IMPLEMENTATIONS else ATTN_SDPA  # a training-only variant: its plain kernel
    micro_batch = rm_plan.micro_batch if rm_plan else (rm_micro_batch_request(rm) or 8)
    offload = bool(rm_plan.offload) if rm_plan else False
    source = resolve_model_source(rm.model.path)
    tokenizer = load_tokenizer(source, rm.model.trust_remote_code)
    kwargs = dict(dtype=dtype, attn_implementation=attn, trust_remote_code=rm.model.trust_remote_code,
                  **dict(rm.model.override_config or {}), **source.load_kwargs())
    if kind == GENERATIVE:
        model = AutoModelForCausalLM.from_pretrained(source.path, **kwargs)
        model.to(dtype)
        rollout = replace(plan.rollout, max_seq_len=(rm_plan.max_length if rm_plan else 1024) + rm.judge.max_new_tokens,
                          rows_per_wave=micro_batch, cuda_graphs=False)
        judge = rm.judge
        return GenerativeJudge(model, tokenizer, plan.device, micro_batch, rm.max_length, judge.prompt_template,
                               judge.verdict_regex, _load_verdict_fn(judge), judge.max_new_tokens, judge.failure_score,
                               offload, SimpleNamespace(rollout=rollout))
    model = AutoModelForSequenceClassification.from_pretrained(source.path, **kwargs)
    model.to(dtype)
    if int(getattr(model.config, "num_labels", 1)) != 1:
        log.warning("reward model %s has %d output labels: its score is label 0's (%s)", rm.model.path,
                    model.config.num_labels, (getattr(model.config, "id2label", None) or {}).get(0, "label 0"))
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return DiscriminativeRewardModel(model, tokenizer, plan.device, micro_batch, rm.max_length,
                                     rm_plan.max_token_len if rm_plan else None, rm.truncation, offload)


def wrap_reward_manager(cfg, plan, rules) -> Any:
    """The run's reward manager: `rules` as it is, or with the reward model in front when reward_model.enable."""
    if not cfg.reward_model.enable:
        return rules
    scorer = build_scorer(cfg, plan)
    log.info("reward model: %s %s on %s (%s)", scorer.kind, cfg.reward_model.model.path, plan.device,
             "offloaded between scorings" if scorer.offload else "resident")
    return ModelRewardManager(scorer, rules, combine_with_custom=bool(cfg.custom_reward_function.path))
