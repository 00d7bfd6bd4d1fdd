#!/bin/bash
# The drafter's data and training on the device in one call: generation stages (the prompts, then sampled repeats of
# them) while time allows, then two trainers side by side (block 4 and block 8) under a time budget that ends before
# LIMIT; the bf16 exports and the logs come back in $OUT in pieces under 16 MB. The shipped drafter's run
# (docs/PERFORMANCE.md, "The shipped drafter") was this script on an H200, then its block-4 run resumed.
#
#   OUT=/tmp/out docs/bench/gpu_train.sh     # on a CUDA machine whose python3 holds torch and this package
#   DEVICE=cpu SCALE=small PYBIN=.venv/bin/python OUT=/tmp/out CACHE_DIR=/tmp/c docs/bench/gpu_train.sh  # dry run
#
# Environment: LIMIT, GEN_END, DEVICE, SCALE (full | small), PYBIN, OUT, SETUP (a script sourced first, e.g. one
# that stages the GGUF and wheels on a machine without network), SHAREGPT (--sharegpt), CACHE_DIR.
set -u -o pipefail
T0=$(date +%s)
LIMIT=${LIMIT:-530}      # seconds after the start by which everything is in $OUT
GEN_END=${GEN_END:-250}  # a generation stage starts only if it is expected to end by then
DEVICE=${DEVICE:-cuda}
SCALE=${SCALE:-full}
PYBIN=${PYBIN:-python3}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
elapsed() { echo $(( $(date +%s) - T0 )); }
# a workplace may stage what the device lacks (the GGUF, the prompts, wheels) with a script of its own
[ -n "${SETUP:-}" ] && source "$SETUP" > $OUT/setup.log 2>&1
CACHE=/dev/shm/dspark-cache; [ -d /dev/shm ] || CACHE=/tmp/dspark-cache
[ -n "${CACHE_DIR:-}" ] && CACHE=$CACHE_DIR
PY="$PYBIN -m dspark_grpc.train.cli"
if [ $SCALE = full ]; then
  DATA="--train-prompts 20000 --heldout-prompts 64 --code-prompts 1000 --stdlib-prompts 1000 --max-new-tokens 256 --gen-batch 2560"
  TRAIN="--steps 200000 --batch 32 --anchors 32 --lr 1.5e-3 --eval-every 1000 --threads 4"
else
  DATA="--train-prompts 24 --heldout-prompts 6 --code-prompts 20 --stdlib-prompts 100 --max-new-tokens 16 --gen-batch 32"
  TRAIN="--steps 2000 --batch 4 --anchors 8 --lr 1e-3 --eval-every 50 --threads 1"
fi
COMMON="--device $DEVICE --compile off ${SHAREGPT:+--sharegpt $SHAREGPT} --cache-dir $CACHE --target-layer-ids 1,28 $DATA"
REPEATS=-1; STAGE=0
for r in 0 1 2 3; do
  start=$(elapsed)
  if [ $r -gt 0 ] && [ $((start + STAGE)) -gt $GEN_END ]; then break; fi
  echo "== generation with $r sampled repeats, at $start s" >> $OUT/gen.log
  $PY --out /tmp/gen $COMMON --sampled-repeats $r --generate-only 2>&1 | tr '\r' '\n' | grep -v '^\s*$' >> $OUT/gen.log || break
  REPEATS=$r; STAGE=$(( $(elapsed) - start ))
done
echo "== generation done with $REPEATS sampled repeats at $(elapsed) s" >> $OUT/gen.log
if [ $REPEATS -ge 0 ]; then
  BUDGET=$($PYBIN -c "print(round(max(0.5, ($LIMIT - $(elapsed) - 100) / 60), 2))")
  echo "== training for $BUDGET minutes from $(elapsed) s" >> $OUT/gen.log
  for b in 4 8; do
    $PY --out /tmp/b$b $COMMON --sampled-repeats $REPEATS --layers 1 --block-size $b --draft-vocab 8192 \
      --markov-rank 64 $TRAIN --time-budget $BUDGET --export /tmp/export-b$b > /tmp/b$b.log 2>&1 &
  done
  wait
  echo "== trained at $(elapsed) s" >> $OUT/gen.log
fi
for b in 4 8; do
  [ -f /tmp/b$b.log ] && tr '\r' '\n' < /tmp/b$b.log | grep -v '^\s*$' | awk '!/ s\/step, eta/ || NR % 200 == 0' > $OUT/b$b.log
  [ -d /tmp/export-b$b ] && (cd /tmp && cp b$b/report.json export-b$b/ 2>/dev/null; tar cf export-b$b.tar export-b$b && split -b 15000000 -d -a 1 export-b$b.tar $OUT/b$b.tar.)
done
ls -la $OUT; tail -3 $OUT/gen.log; grep -h "eval @\|time budget\|exported\|wrote\|Error\|error" $OUT/b4.log $OUT/b8.log | tail -12
