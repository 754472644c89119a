"""Where the time goes when the next rollout overlaps the update (`trainer.async.mode=one_step_off`, one GPU).

One process, one model build: a one_step_off run whose steps are run in groups, each group under one setting of the
pipeline, so that every setting sees the same model, prompts and compiled kernels:

  in_turn      the same pipeline with the phases one after another: each phase's time alone (what sync pays)
  plain        overlapped, the rollout stream at the default priority, Python's default GIL switch interval (5 ms)
  priority     overlapped, the rollout stream at high priority only
  gil          overlapped, a 0.2 ms GIL switch interval only
  both         overlapped, both (the pipeline's stream priority; the GIL interval is the bench's alone)
  carveout     `both`, and the update's cuBLAS GEMMs told to leave --carveout SMs free for the decode kernels
               (torch._C._set_sm_carveout_experimental: PyTorch's experimental knob, set for that group's steps)
  green        `both`, and the whole training step on a stream of a CUDA green context holding all SMs but
               --carveout (torch.cuda.green_contexts, beta): no kernel of the update lands on the SMs left over, which
               the rollout's kernels (on the ordinary context) can always use
  partitionN   `both`, and the SMs split between the phases: the rollout on a green context of N SMs, the training
               step on one of the rest (e.g. partition32; --settings may name several sizes), so neither phase's
               kernels wait for the other's blocks
  update_first overlapped, the priorities the other way round: the training step on a stream of the highest
               priority, the rollout's at the lowest (the default streams'). The update is the step's critical path
               and the rollout has time to spare, so the update's kernels take each SM that frees up first
  spinning     `both`, with the rollout's host waits spinning a CPU core (a plain host read of the GPU's results)
               instead of sleeping on a blocking event (DecodeRunner.wait_for_steps): what the update's CPU thread
               pool loses to them
  all_cores    `both`, with torch's CPU thread pool at every core of the process during the overlapped steps
               instead of the plan's one fewer (plan.cpu_threads: the rollout's thread has a core of its own)
  ref_in_step  with --kl: `both`, but the reference's log-probs computed in the step that trains on the batch, as
               without the pipeline (in every other setting the plan puts them right after the batch's rollout, in
               its job: plan.ref_with_rollout)

Per setting it prints the medians over the group's steps (its first step left out: its batch was generated under
the previous setting): step time, the update's time, the rollout's wall time (in the background when overlapped),
the wait for it, and samples/s. The model is the vs_trl.py GRPO bench's (Qwen2.5-0.5B shape, random weights, the
SmolLM2 tokenizer via RLANYWHERE_BENCH_TOKENIZER):

    python bench/async_overlap.py --out overlap.json                 # H200: 16 prompts x 8, 256 new tokens, bf16
    python bench/async_overlap.py --tiny --per-setting 3              # CPU smoke run (no overlap on a CPU)
    python bench/async_overlap.py --settings in_turn,both,partition24,partition40,partition64 --per-setting 3
    python bench/async_overlap.py --kl --settings in_turn,ref_in_step,both --per-setting 3   # a KL loss term
    python bench/async_overlap.py --settings in_turn,both --profile-dir traces   # where the slowdown comes from

--profile-dir profiles each setting's first measured step (torch.profiler; DIR/<setting>.trace.json) and prints
each CUDA stream's busy and idle time in the step and in its update (trace_gaps.py --streams): beside the update,
a rollout stream busy longer than in turn waited for the card, one idle longer waited for its Python thread.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sides  # noqa: E402
from vs_trl import grpo_overrides  # noqa: E402

# name -> (overlapped, rollout stream priority, GIL switch interval in seconds, SMs the update's GEMMs leave free)
SETTINGS = {
    "in_turn": (False, None, 5e-3, None),
    "plain": (True, 0, 5e-3, None),
    "priority": (True, -1, 5e-3, None),
    "gil": (True, 0, 2e-4, None),
    "both": (True, -1, 2e-4, None),
    "carveout": (True, -1, 2e-4, "carveout"),
    "green": (True, -1, 2e-4, "green"),
    "update_first": (True, 0, 2e-4, "update_first"),
    "spinning": (True, -1, 2e-4, "spinning"),
    "all_cores": (True, -1, 2e-4, "all_cores"),
    "ref_in_step": (True, -1, 2e-4, "ref_in_step"),
}
DEFAULT_SETTINGS = ("in_turn", "plain", "priority", "gil", "both")
PARTITION = "partition"  # partitionN: the rollout on N SMs of a green context, the training step on the rest


def partition_sms(name: str) -> int | None:
    """N of a setting named partitionN, else None."""
    count = name[len(PARTITION):] if name.startswith(PARTITION) else ""
    return int(count) if count.isdigit() else None


def setting(name: str) -> tuple:
    """SETTINGS[name], and for partitionN `both` with the partition (its rollout SMs last)."""
    sms = partition_sms(name)
    return (*SETTINGS["both"][:3], PARTITION, sms) if sms is not None else SETTINGS[name]


COLUMNS = {"s/step": "perf/step_time_s", "update s": "timing/update_actor", "old logp s": "timing/old_log_prob",
           "ref logp s": "timing/ref_log_prob", "rollout s": "async/rollout_s",
           "ref in job s": "async/ref_log_prob_s", "wait s": "timing/rollout_wait",
           "start s": "timing/rollout_weight_sync"}


def schedule(settings: list[str], warmup: int, per_setting: int) -> list[str]:
    """The setting of each step: warm-up steps under the first setting, then `per_setting` steps of each."""
    return [settings[0]] * warmup + [name for name in settings for _ in range(per_setting)]


def summarise(records: list[dict], samples: int, run_ended: bool = False) -> dict:
    """Medians per setting over its steps but the first (whose batch came from the previous setting) and, once the
    run has ended (`run_ended`), its last step (which starts no rollout beside its update). A setting left with no
    step has None figures."""
    out: dict = {}
    by_setting: dict[str, list[dict]] = {}
    for record in records[:-1] if run_ended else records:
        by_setting.setdefault(record["setting"], []).append(record)
    for record in records[-1:] if run_ended else []:  # still a setting of the run, with no steps of its own left
        by_setting.setdefault(record["setting"], [record])
    for name, rows in by_setting.items():
        rows = rows[1:]
        summary = {}
        for column, key in COLUMNS.items():
            values = [row[key] for row in rows if isinstance(row.get(key), (int, float))]
            summary[column] = statistics.median(values) if values else None
        summary["samples/s"] = samples / summary["s/step"] if summary["s/step"] else None
        summary["steps"] = len(rows)
        out[name] = summary
    return out


def format_table(summary: dict) -> str:
    names = ["s/step", "samples/s", "update s", "old logp s", "ref logp s", "rollout s", "ref in job s", "wait s",
             "start s", "steps"]
    lines = [f"{'setting':<13}" + "".join(f"{n:>13}" for n in names)]
    for setting, row in summary.items():
        lines.append(f"{setting:<13}" + "".join(f"{row[n]:>13.3f}" if isinstance(row.get(n), float)
                                                 else f"{row.get(n, '-')!s:>13}" for n in names))
    return "\n".join(lines)


def green_stream(sms: int):
    """A stream of a CUDA green context of `sms` SMs (torch.cuda.green_contexts; the API changed between releases:
    keyword or positional arguments). Every such context starts at the same SMs: two of them overlap."""
    import torch

    green = torch.cuda.green_contexts.GreenContext
    try:
        context = green.create(num_sms=sms, device_id=0)
    except TypeError:
        context = green.create(sms, 0)
    return context, context.Stream()


def all_sms() -> int:
    import torch

    return torch.cuda.get_device_properties(0).multi_processor_count


RESOURCE_BYTES = 512  # a CUdevResource: 144 bytes in CUDA 12.x's ABI, larger in later ones; room for either
SM_COUNT_OFFSET = 96  # its `sm.smCount`: after the type (4 bytes) and 92 bytes of padding, in every ABI so far


def disjoint_green_streams(rollout_sms: int, priority: int):
    """(the training step's stream, the rollout's stream, their SM counts) on two green contexts that share no SM:
    the device's SMs split by CUDA's driver API into a group of `rollout_sms` (rounded up to the card's group size)
    and the remaining ones. torch's GreenContext cannot: it takes each context's SMs from the whole device, so two
    contexts start at the same SMs."""
    import ctypes

    import torch

    torch.cuda.init()
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(result: int, call: str) -> None:
        if result != 0:
            raise RuntimeError(f"{call} failed with CUresult {result} (green contexts need driver >= 12.4)")

    device = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(device), torch.cuda.current_device()), "cuDeviceGet")
    whole, group, remaining = (ctypes.create_string_buffer(RESOURCE_BYTES) for _ in range(3))
    check(cuda.cuDeviceGetDevResource(device, whole, 1), "cuDeviceGetDevResource")  # 1: CU_DEV_RESOURCE_TYPE_SM
    groups = ctypes.c_uint(1)
    check(cuda.cuDevSmResourceSplitByCount(group, ctypes.byref(groups), whole, remaining, 0, rollout_sms),
          "cuDevSmResourceSplitByCount")
    streams, counts = [], []
    for resource in (remaining, group):  # the training step's, then the rollout's
        desc, context, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check(cuda.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1), "cuDevResourceGenerateDesc")
        check(cuda.cuGreenCtxCreate(ctypes.byref(context), desc, device, 1), "cuGreenCtxCreate")  # 1: default stream
        stream_priority = priority if resource is group else 0
        check(cuda.cuGreenCtxStreamCreate(ctypes.byref(stream), context, 1, stream_priority),  # 1: non-blocking
              "cuGreenCtxStreamCreate")
        streams.append(torch.cuda.ExternalStream(stream.value, device=torch.cuda.current_device()))
        counts.append(ctypes.c_uint.from_buffer(resource, SM_COUNT_OFFSET).value)
    return streams[0], streams[1], counts[0], counts[1]


def apply_setting(pipeline, name: str, executor, carveout_sms: int, rollout_stream=None,
                  reference_pass=None, threads: int | None = None, all_threads: int | None = None) -> None:
    """The pipeline's overlap, its rollout stream (`rollout_stream`: one of a green context), the GIL interval and
    where the reference's log-probs run (`reference_pass`: the plan's, None when they run in the step) of setting
    `name`. A rollout started under the previous setting keeps that setting's choice."""
    import torch

    overlapped, priority, interval, partition = setting(name)[:4]
    pipeline.overlap = overlapped
    pipeline.executor = executor if overlapped else None
    pipeline.reference_pass = None if partition == "ref_in_step" else reference_pass
    if overlapped and pipeline.stream is not None:
        pipeline.stream = (rollout_stream if rollout_stream is not None
                           else torch.cuda.Stream(pipeline.plan.device, priority=priority))
    sys.setswitchinterval(interval)
    runner = getattr(getattr(pipeline, "engine", None), "runner", None)  # FastEngine's DecodeRunner
    if runner is not None:  # the instance attribute shadows the method for `spinning`'s steps only
        runner.__dict__.pop("wait_for_steps", None)
        if partition == "spinning":
            runner.wait_for_steps = lambda: None
    pool = all_threads if partition == "all_cores" else threads
    if pool is not None:  # torch's CPU thread pool of the setting (none given: left as it is)
        torch.set_num_threads(pool)
    if torch.cuda.is_available():
        torch._C._set_sm_carveout_experimental(carveout_sms if partition == "carveout" else None)


@contextlib.contextmanager
def profiling(stem: str | None):
    """Profile the block (CPU and CUDA activity) into stem.trace.json and print each stream's busy and idle time
    in the block and in its update; nothing when stem is None."""
    if stem is None:
        yield
        return
    import torch
    from trace_gaps import phase_ranges, stream_lines

    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    on_gpu = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        yield
        if on_gpu:
            torch.cuda.synchronize()
    prof.export_chrome_trace(stem + ".trace.json")
    with open(stem + ".trace.json") as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        print(f"profile {os.path.basename(stem)}: no GPU kernels in the trace (a CPU run)", flush=True)
        return
    windows = [("whole step", min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels))]
    windows += [(name, start, end) for start, end, name in phase_ranges(events) if name == "phase/update_actor"]
    for label, start, end in windows:
        print(f"profile {os.path.basename(stem)}, {label}: {(end - start) / 1e3:.1f} ms", flush=True)
        print("\n".join(stream_lines(events, (start, end))), flush=True)


def write(path: str, records: list[dict], summary: dict, settings: list[str], device: str) -> None:
    with open(path, "w") as handle:
        json.dump({"records": records, "summary": summary, "settings": {k: setting(k) for k in settings},
                   "device": device}, handle, indent=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", help=f"random-weight shape {sorted(sides.SHAPES)}")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS), help=f"comma list of {list(SETTINGS)}")
    parser.add_argument("--carveout", type=int, default=16, help="SMs the `carveout` and `green` settings leave free")
    parser.add_argument("--per-setting", type=int, default=4, help="steps per setting (its first left out)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the first setting's (compiling)")
    parser.add_argument("--kl", action="store_true", help="a KL loss term (actor_rollout_ref.actor.use_kl_loss): a "
                        "reference model, and its log-probs each step")
    parser.add_argument("--tiny", action="store_true", help="tiny model and sizes on the CPU")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--out", default=None, help="write per-step records and the summary as JSON")
    parser.add_argument("--profile-dir", default=None, help="profile each setting's first measured step into DIR")
    args = parser.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS and partition_sms(s) is None]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; choose from {list(SETTINGS)} or partitionN (N: the "
                         "rollout's SMs)")
    if "ref_in_step" in settings and not args.kl:
        raise SystemExit("--settings ref_in_step moves the reference's log-probs, which only a KL term needs: add --kl")

    import torch
    from rlanywhere.config import load_config
    from rlanywhere.api import plan as plan_of_run
    from rlanywhere.trainer import RLTrainer

    if args.tiny:
        args.model, args.prompts, args.n, args.new_tokens = "tiny", 2, 2, 8
    plan_of_steps = schedule(settings, args.warmup, args.per_setting)
    with tempfile.TemporaryDirectory(prefix="async_overlap_") as tmp:
        root = args.work_dir or tmp
        model_dir = sides.materialize_model(os.path.join(root, f"model-{args.model}"), args.model)
        parquet, what = sides.prepare_prompts(root, args.prompts, sides.default_gsm8k_dir())
        work = dict(prompts=args.prompts, n=args.n, new_tokens=args.new_tokens, max_prompt_length=256)
        on_gpu = torch.cuda.is_available() and not args.tiny
        overrides = [*sides.BENCH_RUN_OVERRIDES, f"trainer.default_local_dir={os.path.join(root, 'run')}",
                     *grpo_overrides(work, model_dir, parquet, 1e-6, len(plan_of_steps)),
                     # compiled training passes as a long run has them (the bench's few steps would run eager), as vs_trl.py
                     *(["hardware.precision=bf16", "hardware.compile_training=true"] if on_gpu
                       else ["hardware.device=cpu"]),
                     "trainer.async.mode=one_step_off", "trainer.async.overlap=" + ("true" if on_gpu else "false"),
                     *(["actor_rollout_ref.actor.use_kl_loss=true"] if args.kl else [])]
        print(f"prompts: {what}; model {args.model}; {args.prompts} x {args.n}, {args.new_tokens} new tokens",
              flush=True)
        cfg = load_config(None, overrides)
        plan = plan_of_run(cfg)  # applied to the process as a run's is: TF32 for the fp32 matmuls where the card has it
        trainer = RLTrainer(cfg, plan, cfg.trainer.default_local_dir)
        pipeline = trainer.pipeline
        print(f"async rollout: {plan.async_rollout} ({plan.reasons.get('async_rollout')})", flush=True)
        if "ref_with_rollout" in plan.reasons:
            print(f"reference log-probs: {'with the rollout' if plan.ref_with_rollout else 'in the step'} "
                  f"({plan.reasons['ref_with_rollout']})", flush=True)
        executor, reference_pass = pipeline.executor, pipeline.reference_pass
        if executor is None:
            print("the plan runs the phases in turn here (no CUDA overlap): every setting below is in turn", flush=True)
        records: list[dict] = []
        train_step = trainer.train_step
        threads = torch.get_num_threads()  # the plan's (one core left to an overlapped rollout's thread)
        device = torch.cuda.get_device_name(0) if on_gpu else "CPU"
        greens = {}  # setting -> (the training step's stream, the rollout's), made at the setting's first step

        def streams_of(name: str):
            """Made when the setting's steps start, so that one the card cannot make (green contexts need CUDA 12.4)
            stops the bench only after the settings before it were measured and written."""
            if name in greens or not on_gpu:
                return greens.get(name, (None, None))
            spec = setting(name)
            kind = spec[3]
            if kind == "green":
                greens[name] = (green_stream(all_sms() - args.carveout)[1], None)
            elif kind == "update_first":
                highest = torch.cuda.Stream.priority_range()[1] if hasattr(torch.cuda.Stream, "priority_range") \
                    else -1
                greens[name] = (torch.cuda.Stream(priority=highest), None)
            elif kind == PARTITION:
                update_stream, rollout_stream, update_sms, rollout_sms = disjoint_green_streams(spec[4], spec[1])
                greens[name] = (update_stream, rollout_stream)
                print(f"{name}: the rollout on {rollout_sms} SMs, the training step on the other {update_sms}",
                      flush=True)
            return greens.get(name, (None, None))

        def step(items):
            name = plan_of_steps[trainer.global_step]
            update_stream, rollout_stream = streams_of(name)
            apply_setting(pipeline, name, executor, args.carveout, rollout_stream, reference_pass, threads,
                          threads + 1 if plan.cpu_threads else threads)
            if update_stream is not None:  # the step's own work (update, log-probs) on its green context's SMs
                update_stream.wait_stream(torch.cuda.current_stream())
            profiled = args.profile_dir and trainer.global_step in profiled_steps
            with torch.cuda.stream(update_stream) if update_stream is not None else contextlib.nullcontext(), \
                    profiling(os.path.join(args.profile_dir, name) if profiled else None):
                metrics = train_step(items)
            if update_stream is not None:
                torch.cuda.current_stream().wait_stream(update_stream)
            records.append({"step": trainer.global_step + 1, "setting": name,
                            **{key: metrics.get(key) for key in COLUMNS.values()}})
            print(f"step {trainer.global_step + 1} [{name}] " + " ".join(
                f"{column}={metrics[key]:.3f}" for column, key in COLUMNS.items()
                if isinstance(metrics.get(key), float)), flush=True)
            if args.out:  # every step: a later setting that fails leaves the earlier ones' figures
                write(args.out, records, summarise(records[args.warmup:], samples), settings, device)
            return metrics

        samples = args.prompts * args.n
        # each setting's second step after the warm-up (its first measured one: summarise leaves the first out)
        profiled_steps = {args.warmup + k * args.per_setting + 1 for k in range(len(settings))} \
            if args.per_setting > 1 else set()
        trainer.train_step = step
        trainer.fit()
    summary = summarise(records[args.warmup:], samples, run_ended=True)
    print(f"\n{samples} samples/step; medians per setting (first step of each and the run's last left out)")
    print(format_table(summary))
    if args.out:
        write(args.out, records, summary, settings, device)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
