#!/usr/bin/env bash
# The GPU part of docs/reproduction.md on a machine reached through calls of at most 10 minutes:
#
#   bash reproduction/gpu_session.sh start    # arms in the background (setsid), bias probes, progress
#   bash reproduction/gpu_session.sh launch   # only the arms in the background; returns at once
#                                             # (TRUNK=ARM@STEP: trunk first, arms branch from it)
#   bash reproduction/gpu_session.sh wait     # progress until this call's budget is spent
#   bash reproduction/gpu_session.sh finish   # wait for the arms, gradient study, pack the results
#
# On a machine without call limits, `start` then `finish` is the whole job. Needs data/mix
# (python -m train --corpus mix --prepare-only). Results go to $OUT (default $REPRO_DIR/out);
# every phase also packs the partial results, so a lost machine loses at most one call.
set -uo pipefail
phase=${1:?usage: gpu_session.sh launch|start|wait|finish}
W=${REPRO_DIR:-/tmp/repro}
OUT=${OUT:-$W/out}
LRS=${LRS:-1e-3,3e-3}
TIME_LIMIT=${TIME_LIMIT:-1140}     # seconds of training per arm
CALL_SECONDS=${CALL_SECONDS:-560}  # how long start/wait may run
ARMS=${ARMS:-}                      # comma list of NUMERICS/MAX_ADJUST (default: explosion.ARMS)
GRAD_LR=${GRAD_LR:-0.003}          # which learning rate's run the gradient study reads ...
GRAD_ARM=${GRAD_ARM:-paper-off}    # ... and which arm's directory
GRAD_COMPARE=${GRAD_COMPARE:-}     # arms the study recomputes (default: gradients.py's)
GRAD_STEPS=${GRAD_STEPS:-20}
GRAD_STEP=${GRAD_STEP:-before-instability}
EXPLOSION_ARGS=${EXPLOSION_ARGS:-}  # more arguments for `explosion run` (e.g. a smoke test's config)
TRUNK=${TRUNK:-}                   # ARM@STEP: arms branch from ARM's checkpoint at STEP (explosion --trunk)
END_IN=${END_IN:-}                 # arms stop this many seconds after launch (instead of TIME_LIMIT)
GRAD_TIMEOUT=${GRAD_TIMEOUT:-0}    # seconds the gradient study may take (0: no limit)
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
mkdir -p "$W" "$OUT"
t0=$(date +%s)
running() { pgrep -f "reproduction.explosion run" >/dev/null; }
pack() {
  (cd "$W" && tar czf "$OUT/results.tar.gz" --ignore-failed-read \
     $(ls -d explosion.log probe*.log explosion/explosion.* gradients \
        explosion/{,trunk/}*/*/{metrics.jsonl,summary.json,train.log,stdout.log,branch.json} 2>/dev/null))
}
progress() {
  while running && [ $(( $(date +%s) - t0 )) -lt "$CALL_SECONDS" ]; do sleep 15; done
  tail -n 2 "$W/explosion.log"
}

launch() {
  nvidia-smi -L
  setsid nohup python3 -m reproduction.explosion run --out "$W/explosion" --lrs "$LRS" \
      ${ARMS:+--arms "$ARMS"} ${TRUNK:+--trunk "$TRUNK"} --report-every 60 $EXPLOSION_ARGS \
      $([ -n "$END_IN" ] && echo --end-by $(( $(date +%s) + END_IN )) || echo --time-limit "$TIME_LIMIT") \
      >"$W/explosion.log" 2>&1 </dev/null &
}

case $phase in
launch)
  launch ;;
start)
  launch
  # The probes share GPU 0 with its runs through a small memory slice.
  export CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.06
  python3 -m stable_attn.diagnostics --implementations pallas_gpu,reference,xla,jax.nn --gradients \
      --out "$OUT/bias_probe_gpu.md" >"$W/probe.log" 2>&1; echo "probe: exit $?"
  python3 -m stable_attn.diagnostics --implementations cudnn --numerics fast --max-adjust off \
      --out "$OUT/bias_probe_gpu_cudnn.md" >"$W/probe_cudnn.log" 2>&1; echo "cudnn probe: exit $?"
  unset CUDA_VISIBLE_DEVICES XLA_PYTHON_CLIENT_MEM_FRACTION
  progress; pack ;;
wait)
  progress; pack ;;
finish)
  while running; do sleep 5; done
  tail -n 12 "$W/explosion.log"
  python3 -m reproduction.explosion report --out "$W/explosion" --lrs "$LRS" ${ARMS:+--arms "$ARMS"} \
      2>&1 | tail -n 20
  pack  # the runs are safe before the study starts
  timeout "$GRAD_TIMEOUT" python3 -m reproduction.gradients --run "$W/explosion/lr$GRAD_LR/$GRAD_ARM" \
      --step "$GRAD_STEP" --steps "$GRAD_STEPS" ${GRAD_COMPARE:+--compare "$GRAD_COMPARE"} --data data/mix \
      --out "$W/gradients/gradients.json" 2>&1 | tee "$W/gradients.log" | tail -n 60
  pack ;;
*)
  echo "unknown phase $phase (launch, start, wait or finish)" >&2; exit 2 ;;
esac
