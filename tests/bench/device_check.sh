#!/bin/sh
# The accelerator checks, one short run (at most about 10 minutes):
#  1. one chip (tests/bench/device_bench.py): the tiny fixture models' logits against transformers', and
#     decode tok/s at 1 and 8 rows and prefill tok/s of a random Qwen3-8B-shaped model in bfloat16,
#     int8 and fp8, each beside the HBM-bandwidth bound of the chip's name, and one FP8 matrix's
#     product three ways;
#  2. the spec's model, Qwen3.8-27B with random weights, served (tests/bench/device_qwen38.py):
#     time per output token at 1 and 16 busy slots, an 8k prefill, what it holds, bfloat16 and fp8,
#     beside the published figures (QWEN38_LAYERS=N: the shape cut to N layers, a shorter run);
#  3. tensor parallelism: the tiny dense, MoE, int8 and hybrid models split over every power-of-two count
#     of the machine's chips give the logits of one chip (tests/tp_parity.py).
#
#     sh tests/bench/device_check.sh            (from the project folder, jax with the chips' plugin)
#     LAYERS=12 sh tests/bench/device_check.sh  (a shallower random model: fewer seconds compiling)
#
# On a CPU machine part 1 says it found no GPU; with one chip part 2 has nothing to compare. Both exit 0.
set -eu
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
# Split runs differ from one chip's logits by the order of the all-reduced sums only; accelerators
# multiply float32 in reduced-precision passes (TF32) and int8 weights in bfloat16, hence not 1e-4.
TOLERANCE=${TOLERANCE:-2e-2}

bench=0
"$PYTHON" tests/bench/device_bench.py ${LAYERS:+--layers "$LAYERS"} || bench=1
"$PYTHON" tests/bench/device_qwen38.py ${QWEN38_LAYERS:+--layers "$QWEN38_LAYERS"} || bench=1

chips=$("$PYTHON" -c 'import jax; print(len(jax.devices()))')
platform=$("$PYTHON" -c 'import jax; print(jax.default_backend())')
if [ "$chips" -lt 2 ]; then
    echo "device_check: this machine has $chips $platform device(s): a split needs at least 2, nothing to compare"
    exit "$bench"
fi
counts=1
n=2
while [ "$n" -le "$chips" ]; do
    counts="$counts $n"
    n=$((n * 2))
done
echo "device_check: $chips $platform devices; comparing $counts"
status=0
for case in "qwen3 float32" "qwen3-moe float32" "qwen3 int8" "qwen3-next float32"; do
    set -- $case
    # shellcheck disable=SC2086
    "$PYTHON" tests/tp_parity.py "tests/fixtures/tiny/$1" --weights-dtype "$2" --devices $counts \
        --check "$TOLERANCE" || status=1
done
[ "$status" -eq 0 ] && echo "device_check: every split matches one chip within $TOLERANCE" \
    || echo "device_check: a split differs from one chip by more than $TOLERANCE"
[ "$bench" -eq 0 ] || status=1
exit "$status"
