#!/usr/bin/env bash
# docs/reproduction.md's seeds (issue 12 item 3) on one GPU reached through calls of at most 10 minutes:
# one wave of arms side by side per seed, the waves back to back in the background.
#
#   bash reproduction/seeds_session.sh start   # chain the waves (setsid); returns at once
#   bash reproduction/seeds_session.sh wait    # progress until CALL_SECONDS pass or the last wave ends; pack
#
# Each wave is `gpu_session.sh launch` with --seed N (initial weights and batch order) and --max-steps
# STEPS on the full schedule (--lr-decay-steps pins the cosine where the seed-0 runs have it). With
# DEADLINE_IN, every wave stops (checkpointed) by DEADLINE_IN seconds after `start`: a lease that runs
# short keeps shorter runs instead of losing them (a wave with under MIN_WAVE seconds left is not
# started); without it each run has gpu_session.sh's TIME_LIMIT. Results: $OUT/seedN/results.tar.gz,
# whose explosion/lr*/ARM/ directories are what docs/results/reproduction/seeds/seedN/ holds.
set -uo pipefail
phase=${1:?usage: seeds_session.sh start|wait}
SEEDS=${SEEDS:-1,2}
ARMS=${ARMS:-paper/off,paper/safe,fast/off}
LR=${LR:-3e-3}
STEPS=${STEPS:-2500}
DECAY_STEPS=${DECAY_STEPS:-20000}  # the repro config's max_steps: the seed-0 runs' schedule
DEADLINE_IN=${DEADLINE_IN:-}
MIN_WAVE=${MIN_WAVE:-120}          # seconds: start-up and compilation take about a minute
EXTRA_ARGS=${EXTRA_ARGS:-}           # more arguments for `explosion run` (e.g. a smoke test's --config)
CALL_SECONDS=${CALL_SECONDS:-560}
ROOT=${SEEDS_DIR:-/tmp/seeds}
OUT=${OUT:-$ROOT/out}
mkdir -p "$ROOT" "$OUT"
t0=$(date +%s)
running() { pgrep -f "reproduction.explosion run" >/dev/null; }

chain() {
  local deadline=$(( t0 + ${DEADLINE_IN:-0} ))
  for s in ${SEEDS//,/ }; do
    while running; do sleep 5; done
    local end_in=""
    [ -n "$DEADLINE_IN" ] && end_in=$(( deadline - $(date +%s) ))
    if [ -n "$end_in" ] && [ "$end_in" -lt "$MIN_WAVE" ]; then
      echo "$(date +%T) seed $s: not started, ${end_in}s left before the deadline"; continue
    fi
    echo "$(date +%T) seed $s: launch${end_in:+, ends in ${end_in}s}"
    REPRO_DIR="$ROOT/seed$s" OUT="$OUT/seed$s" LRS="$LR" ARMS="$ARMS" END_IN="$end_in" \
      EXPLOSION_ARGS="--seed $s --max-steps $STEPS --lr-decay-steps $DECAY_STEPS ${EXTRA_ARGS:-}" \
      bash reproduction/gpu_session.sh launch
    sleep 15  # the runs' processes are up before the next `running` check
  done
  while running; do sleep 5; done
  echo "$(date +%T) all waves done"
}

case $phase in
start)
  if [ -f "$ROOT/chain.pid" ] && kill -0 "$(cat "$ROOT/chain.pid")" 2>/dev/null; then
    echo "a chain is already running (pid $(cat "$ROOT/chain.pid")); use wait" >&2; exit 2
  fi
  rm -f "$ROOT/chain.log"
  setsid nohup bash "$0" chain >"$ROOT/chain.log" 2>&1 </dev/null &
  echo $! >"$ROOT/chain.pid"
  sleep 2; cat "$ROOT/chain.log" ;;
chain)
  chain ;;
wait)
  while ! grep -q "all waves done" "$ROOT/chain.log" 2>/dev/null \
        && [ $(( $(date +%s) - t0 )) -lt "$CALL_SECONDS" ]; do sleep 10; done
  cat "$ROOT/chain.log"
  for s in ${SEEDS//,/ }; do
    [ -d "$ROOT/seed$s" ] || continue
    echo "== seed $s"
    REPRO_DIR="$ROOT/seed$s" OUT="$OUT/seed$s" CALL_SECONDS=0 bash reproduction/gpu_session.sh wait
  done ;;
*)
  echo "unknown phase $phase (start or wait)" >&2; exit 2 ;;
esac
