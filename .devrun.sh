#!/bin/bash
# device run: overlap settings bench, then time-to-accuracy sync vs one_step_off on the GRPO demo
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-35}
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout ${BENCH_T:-150} python bench/async_overlap.py --per-setting 3 --out $OUT/overlap.json 2>&1 | grep -v "run:" | tee $OUT/overlap.log | grep -v "^step [0-9]*/" | tail -22
for mode in sync osp; do
  extra=""; [ $mode = osp ] && extra="trainer.async.mode=one_step_off"
  timeout ${TTA_T:-200} python bench/time_to_accuracy.py run --algo grpo --steps $STEPS --test-freq 5 --work-dir /tmp/tta \
     --out $OUT/tta-$mode.json -- $extra 2>&1 | grep -v "run:" > $OUT/tta-$mode.log
  tail -3 $OUT/tta-$mode.log
  cp /tmp/tta/runs/grpo/metrics.jsonl $OUT/metrics-$mode.jsonl; cp /tmp/tta/runs/grpo/plan.json $OUT/plan-$mode.json
  python - $OUT/metrics-$mode.jsonl <<'PY'
import json,sys,statistics as st
rs=[json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rs=[r for r in rs if "perf/step_time_s" in r][2:]
for k in ["perf/step_time_s","timing/update_actor","timing/old_log_prob","timing/rollout","timing/rollout_wait","async/rollout_s","timing/rollout_weight_sync","perf/peak_memory_gib"]:
    v=[r[k] for r in rs if isinstance(r.get(k),(int,float))]
    print(f"  {k}: median {st.median(v):.3f}" if v else f"  {k}: -")
PY
done
