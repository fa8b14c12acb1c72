#!/usr/bin/env bash
# Measure steps on the GPU machine, for the device calls that follow the stage call (bench/README.md):
#   source .device/bin/install.sh && bash bench/h200_cycle.sh STEP...
# Steps (run in the order given, each under a timeout so that the output comes back within a call's 10 minutes):
#   tests          every gpu-marked test (each kernel used on the device and equal to its reference)
#   profile        per-kernel CUPTI times of the compiled decode step, first 4 layers (bench/gpu_profile.py)
#   prefill        the same for one 2048-token prefill chunk
#   bench[:N]      `ds4-mlx bench --synthetic q2` over N layers (default 43): decode at 512 and 2k, the real
#                  launch count (`--ops`: compare it with `--ops-for cuda`, bench/RESULTS.md)
# The PTX cache a previous call left in .device/cache/ptx.tgz is unpacked first (NVRTC costs ~2 s a kernel cold)
# and packed again into $OUT/ptx.tgz at the end: copy it to .device/cache/ for the next machine.
# Full outputs are written under $OUT; the tail of each is printed.
set -u
out=${OUT:-/tmp/out}
limit=${CYCLE_LIMIT:-570}
mkdir -p "$out" /tmp/ptx
[ -f .device/cache/ptx.tgz ] && [ ! -f /tmp/ptx/.unpacked ] && tar -xzf .device/cache/ptx.tgz -C /tmp/ptx && touch /tmp/ptx/.unpacked
export MLX_PTX_CACHE_DIR=/tmp/ptx PYTHONPATH=$PWD:${PYTHONPATH:-}
start=$(date +%s)
left() { echo $(( limit - ($(date +%s) - start) - ${1:-0} )); }
for step in "$@"; do
  echo "== $step ($(( $(date +%s) - start )) s in, $(left) s left)"
  case $step in
    tests)
      DS4_TEST_DEVICE=gpu timeout "$(left 250)" python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rfE \
        --durations=10 tests/ > "$out/gpu_tests.txt" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_tests.txt" | cut -c1-220 | tail -30 ;;
    profile)
      timeout "$(left 120)" python3 bench/gpu_profile.py --layers 4 --top 40 > "$out/profile.txt" 2>&1
      grep -v "warnings.warn" "$out/profile.txt" | cut -c1-170 | tail -48 ;;
    prefill)
      timeout "$(left 60)" python3 bench/gpu_profile.py --layers 4 --prefill 2048 --top 30 > "$out/prefill.txt" 2>&1
      grep -v "warnings.warn" "$out/prefill.txt" | cut -c1-170 | tail -38 ;;
    bench*)
      layers=${step#bench}; layers=${layers#:}; layers=${layers:-43}
      timeout "$(left 15)" python3 -m ds4_mlx.cli bench --synthetic q2 --layers "$layers" --ctx-start 512 \
        --ctx-max 2048 --step-mul 4 --gen-tokens 32 --ops --json > "$out/bench$layers.json" 2> "$out/bench$layers.err"
      echo "rc $?"
      grep -iv "warnings.warn\|it/s\]" "$out/bench$layers.err" | cut -c1-250 | tail -25
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d)[:3000])" "$out/bench$layers.json" 2>&1 | tail -3 ;;
    *) echo "unknown step $step" ;;
  esac
done
tar -czf "$out/ptx.tgz" -C /tmp/ptx .
echo "== done in $(( $(date +%s) - start )) s"
