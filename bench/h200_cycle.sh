#!/usr/bin/env bash
# One measure cycle on the GPU machine, for the device call that follows the stage call (bench/README.md):
#   source .device/bin/install.sh && bash bench/h200_cycle.sh [LAYERS]
# 1. unpacks the PTX cache a previous cycle left in .device/cache/ptx.tgz (NVRTC costs ~2 s a kernel cold),
# 2. runs every gpu-marked test of the kernels (each must be used on the device and equal its reference),
# 3. profiles the decode step of the first 4 layers per kernel (bench/gpu_profile.py),
# 4. walks `ds4-mlx bench --synthetic q2` over LAYERS layers (default 43) at 2k, with the real launch count
#    (`--ops`: compare it with `--ops-for cuda` planned on the CPU, bench/RESULTS.md),
# 5. packs the PTX cache into $OUT/ptx.tgz: copy it to .device/cache/ for the next machine.
# Each step runs under a timeout so that the output comes back within the 10-minute call limit.
set -u
layers=${1:-43}
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/ptx
[ -f .device/cache/ptx.tgz ] && tar -xzf .device/cache/ptx.tgz -C /tmp/ptx
export MLX_PTX_CACHE_DIR=/tmp/ptx PYTHONPATH=$PWD:${PYTHONPATH:-}
start=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - start) )); }
echo "== gpu tests"
DS4_TEST_DEVICE=gpu timeout "$(left 240)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_*.py 2>&1 | tail -15
echo "== decode profile, 4 layers ($(left 0 | tr -d -) s in)"
timeout "$(left 330)" python3 bench/gpu_profile.py --layers 4 --top 25 2>&1 | grep -v "warnings.warn" | cut -c1-200
echo "== bench, $layers layers ($(left 0 | tr -d -) s in)"
timeout "$(left 560)" python3 -m ds4_mlx.cli bench --synthetic q2 --layers "$layers" --ctx-start 2048 --ctx-max 2048 \
  --gen-tokens 32 --ops --json > "$out/bench.json" 2> "$out/bench.err"
grep -i "not used\|Traceback\|ds4-mlx bench" "$out/bench.err" | cut -c1-300 | tail -12
tar -czf "$out/ptx.tgz" -C /tmp/ptx .
echo "== done in $(left 0 | tr -d -) s"
