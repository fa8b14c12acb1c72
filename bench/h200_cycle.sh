#!/usr/bin/env bash
# Measurement steps on a machine with an NVIDIA GPU and MLX's CUDA build (`pip install -e '.[cuda]'`,
# bench/README.md), from the repository's root:
#   bash bench/h200_cycle.sh STEP...
# Steps (run in the order given, each under a timeout: CYCLE_LIMIT seconds in all, default 570):
#   tests[:A,B]    every gpu-marked test (each kernel used on the device and equal to its reference); with names,
#                  only tests/test_kernels_A.py (or tests/test_A.py where that is none), ...
#   profile[:N[:AT]] per-kernel CUPTI times of the compiled decode step, first N layers (default 4; at 4 or fewer
#                  every kernel in the order it ran) after AT tokens (default 40), and the step fed ahead: host call,
#                  submit, wait, and the same through the session (bench/gpu_profile.py)
#   replay[:N[:AT]] one recorded decode step over N layers (default 43) after AT tokens (default 2048) replayed as one
#                  CUDA graph of our own, against MLX's step fed ahead (bench/graph_replay.py)
#   decoder[:N[:AT]] where a token's time goes through the decode graphs (bench/graph_decoder.py): the session's
#                  loop part by part, each kind's graph alone, the GPU timeline of a few tokens (default 43 layers, 2k)
#   diff[:N[:AT]]  where the decode graph first parts from MLX, launch by launch (bench/graph_diff.py)
#   prefill[:C[:N[:AT]]] the same for one C-token prefill chunk (default 4096; the session's chunk on CUDA is
#                  12288) over N layers (default 4) at position AT (default 3C; 0: a prompt's first chunk), with
#                  the timeline's idle gaps: their sum and the largest, between which kernels
#   bench[:N[:MAX]] `ds4-mlx bench --synthetic q2` over N layers (default 43): decode at 512, 2k and on to MAX
#                  tokens (default 2048; 32768 adds 8k and 32k, ~70 s more of prefill), the real launch count (`--ops`: compare it with `--ops-for cuda`, bench/RESULTS.md)
#   plans[:FLAGS]  the decode matvec kernel at Flash's shapes under every launch plan (bench/matvec_plans.py);
#                  FLAGS its options without dashes, comma-separated (cold,chosen or cold-gb=16,chosen): cold, each
#                  call reads its weights from memory, not the L2, as in a decode step
#   attnplans      the decode attention kernel with each head's keys shared by 1, 2, 4, 8 threadgroups at Flash's
#                  shapes (bench/attention_plans.py): what kernels/decode/attention.py's splits_for should choose
#   experts        the decode expert kernels under other threadgroup counts (bench/expert_plans.py)
#   kinds[:N]      decode t/s over N layers (default 12) with the step's kinds (rows written only when a window
#                  ends) against one step that always writes, in one process (bench/step_kinds.py)
#   readback[:N]   decode at 2k over N layers (default 43) as sampled decoding runs: each token read back before
#                  the next step is built (`--read-back`; the bench step feeds tokens ahead, as greedy decoding does)
#   file           issue 10's file path: the full q2 file and its MTP file written into a tmpfs (make-model
#                  --repeat, 16 jobs), then `ds4-mlx bench -m` on it: load time and GB/s, host peak RSS, decode at 2k with
#                  the MTP verify costs (`--mtp-draft 3`)
#   pressure[:FILL[:N]] the device memory budget under a full host (bench/host_pressure.py): `ds4-mlx bench --synthetic
#                  q2` over N layers (default 28, the H100's case) at 12k with the host free, with FILL GB (default 80)
#                  of it taken by a tmpfs file, the same in 4096-token chunks, and a 2k..8k walk; each passes when it
#                  finishes and the host's available memory falls by no more than the process's own RSS (+4 GB)
#   pressurefile[:FILL] the same for the full q2 file in a tmpfs (the H200): `run` on a ~10k-token prompt (the
#                  README three times) and `bench -m` 2k..32k on it, FILL GB more of the host taken (default 0)
#   chunks[:N[:SIZES]] prefill t/s of a 16k prompt over N layers (default 12) in chunks of each size (default
#                  1024,2048,4096; issue 9: the chunk size chosen for speed)
#   ttft[:N[:CTX[:CHUNK]]] time to first token of a CTX-token prompt (default 11520: Claude Code's system prompt
#                  and tools, issue 9's <= 3 s): `ds4-mlx bench` prefilling 0 -> CTX over N layers (default 43) in
#                  the session's chunks (or CHUNK tokens), then 16 tokens; DS4_REFERENCE_PATHS=name,... before the
#                  command keeps those fast paths on their references (one measured against the rest in one run)
#   startup[:N]    load and warm-up seconds of `ds4-mlx bench --synthetic q2 --layers N` (default 4) three times: with
#                  an empty kernel cache (kernels/machinery/nvrtc.py compiles), again (it reads them back), and with
#                  DS4_CUDA_CACHE=off (MLX compiles every kernel, as before the cache)
#   loadpaths      host bytes to device arrays, 16 GB of a tmpfs file (the file step's, else random bytes), by
#                  bench/load_paths.py's pinned path (the loader's on CUDA), memcpy path (3.7 GB/s on 2026-12-02) and
#                  mx.load path (3.5 GB/s), 8 threads each: issue 10's 15 s
#   knobs[:N[:C]]  decode at 2k over N layers (default 12) under the first C (default 3) of MLX's CUDA graph
#                  settings: its defaults (on the
#                  H200 a graph is committed after 100 nodes or once its nodes' inputs pass 1000 MB: a decode
#                  step's expert kernels take the whole 1.1 GB banks as inputs, so most MoE layers end a graph),
#                  then the MB limit lifted, then that with 1000-node graphs. Measured before: the MB limit lifted
#                  29% slower (2026-12-02, before decoding fed tokens ahead); no CUDA graphs, 25-node graphs and a
#                  4000-graph cache within the spread of the defaults (2026-12-02)
#   ab:DIR[:N[:CTX]] prefill from 0 to CTX tokens (default 2048) then decode there (128 tokens) over N layers
#                  (default 43) with the tree in DIR (another commit's `git archive`: untracked and not ignored,
#                  or copied beside this one), then with this one, on the same machine (both inherit the
#                  environment: DS4_GRAPH_DECODE=off compares MLX's steps)
#   graph[:N[:CTX[:MODES]]] the same bench with this tree, greedy decoding through MLX's compiled step
#                  (DS4_GRAPH_DECODE=off) and through the decode graphs (=on, the default on CUDA,
#                  model/graphstep.py), on the same machine; MODES one of them (default off,on)
#   gemms[:ONLY]   prefill's tensor-core GEMMs at Flash's shapes, one 4096-token chunk (bench/prefill_gemms.py;
#                  ONLY raw, dense or half: those rows alone)
#   ncu[:REGEX]    Nsight Compute (/usr/local/cuda/bin/ncu, --set full) on each GEMM of `gemms` run once, the kernels
#                  whose names match REGEX (default the tensor-core GEMMs): time, issue rate, stall
#                  reasons, executed SASS by opcode per HMMA (bench/ncu_summary.py; with the most stalled
#                  instructions in $OUT/ncu_summary.txt; each kernel's whole SASS with its stall samples in $OUT/sass/)
#   ncuattn[:R1,R2] the same on bench/chunk_attention.py, the first launch whose name matches each regex (default
#                  the chunk attention's "picked" kernel at 32 heads, then the indexer's tensor-core scores)
#   ablate         those GEMMs timed again with one part of the kernel taken out at a time: drain, barrier, loads,
#                  mma, lo pass, W decode (bench/gemm_ablate.py): what each part costs where nothing hides it
#   mma            the mma.sync ceiling those GEMMs' instruction has at 8, 16 and 32 warps an SM (bench/mma_ceiling.py)
#   attn           the chunk attention kernels (SIMT, tensor cores at 16 and 32 heads a threadgroup) at Flash's
#                  shapes, 4096 queries from position 8192 (bench/chunk_attention.py)
# A kernel cache left by an earlier run in .device/cache/ptx.tgz (MLX's own kernels, and under ds4/ the custom
# kernels' cubins, kernels/machinery/nvrtc.py) is unpacked first and packed again into $OUT/ptx.tgz at the end: copy
# it to .device/cache/ to start the next machine warm. Kernels are compiled per session context (their templates
# hold it), so every step here uses the bench's: 2048 + 32 tokens.
# Full outputs are written under $OUT (default /tmp/out); the tail of each is printed.
set -u
out=${OUT:-/tmp/out}
limit=${CYCLE_LIMIT:-570}
mkdir -p "$out" /tmp/ptx
[ -f .device/cache/ptx.tgz ] && [ ! -f /tmp/ptx/.unpacked ] && tar -xzf .device/cache/ptx.tgz -C /tmp/ptx && touch /tmp/ptx/.unpacked
export MLX_PTX_CACHE_DIR=/tmp/ptx DS4_CUDA_CACHE=/tmp/ptx/ds4 PYTHONPATH=$PWD:${PYTHONPATH:-}
start=$(date +%s)
left() { local n=$(( limit - ($(date +%s) - start) - ${1:-0} )); echo $(( n > 1 ? n : 1 )); }  # seconds for a step
step_n() { local n=${step#*:}; [ "$n" = "$step" ] && n=$1; echo "$n"; }  # N of STEP:N, else the default given
figures() {  # one line from a `ds4-mlx bench --json` file: load, warm-up, and the first frontier's figures
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); f=d['frontiers'][0]; print('load', d['load_seconds'], 's, warm-up', d['warmup_seconds'], 's, prefill', f['prefill_tps'], 't/s, decode', f['gen_tps'], 't/s, peak', round(f['peak_memory_bytes'] / 1e9, 1), 'GB')" "$1" 2>&1 | tail -1
}
for step in "$@"; do
  echo "== $step ($(( $(date +%s) - start )) s in, $(left) s left)"
  case $step in
    tests*)
      files="tests/test_kernels_*.py tests/test_fused_linear.py"
      [ "$step" != tests ] && files=$(for n in $(echo "${step#tests:}" | tr ',' ' '); do  # NAME: test_kernels_NAME.py
        [ -f "tests/test_kernels_$n.py" ] && echo "tests/test_kernels_$n.py" || echo "tests/test_$n.py"; done)
      # unit tests first, the tiny-model decode tests last (they compile their kernels at new shapes); a test that
      # runs past 150 s fails with every thread's stack (pytest-timeout, installed there): a GPU hang shows where
      for sel in "not tiny" "tiny"; do
        DS4_TEST_DEVICE=gpu timeout "$(left 5)" python3 -m pytest -v -m gpu -k "$sel" -p no:cacheprovider --tb=short \
          -rfE --timeout 150 --durations=10 $files \
          >> "$out/gpu_tests.txt" 2>&1
      done
      grep -E "^(FAILED|ERROR)| passed| failed|Timeout" "$out/gpu_tests.txt" | cut -c1-220 | tail -30
      echo "$(grep -c PASSED "$out/gpu_tests.txt") passed; last: $(grep "::" "$out/gpu_tests.txt" | tail -1 | cut -c1-150)" ;;
    profile*)
      IFS=: read -r _ layers at <<< "$step:"; layers=${layers:-4}; at=${at:-40}
      lines=""; [ "$layers" -le 4 ] && lines=--timeline
      timeout "$(left 60)" python3 bench/gpu_profile.py --layers "$layers" --at "$at" --ctx $(( at + 128 )) --top 40 $lines \
        > "$out/profile$layers.txt" 2>&1
      grep -v "warnings.warn\|_warn_once\|UserWarning" "$out/profile$layers.txt" | cut -c1-120 | head -150 ;;
    prefill*)
      IFS=: read -r _ chunk layers at <<< "$step:"; chunk=${chunk:-4096}; layers=${layers:-4}; at=${at:-$(( 3 * chunk ))}
      timeout "$(left 60)" python3 bench/gpu_profile.py --layers "$layers" --prefill "$chunk" --prefill-at "$at" \
        --top 90 --timeline > "$out/prefill.txt" 2>&1
      grep -v "warnings.warn\|_warn_once\|UserWarning\|^   *[0-9.]* *[0-9.]* us  gap" "$out/prefill.txt" | cut -c1-170 \
        | head -60 ;;
    bench*)
      IFS=: read -r _ layers max <<< "$step:"; layers=${layers:-43}; max=${max:-2048}
      timeout "$(left 15)" python3 -m ds4_mlx.cli bench --synthetic q2 --layers "$layers" --ctx-start 512 \
        --ctx-max "$max" --step-mul 4 --gen-tokens 32 --ops --json > "$out/bench$layers.json" 2> "$out/bench$layers.err"
      echo "rc $?"
      grep -iv "warnings.warn\|it/s\]" "$out/bench$layers.err" | cut -c1-250 | tail -25
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d)[:3000])" "$out/bench$layers.json" 2>&1 | tail -3 ;;
    plans*)
      flags=""; [ "$step" != plans ] && flags=$(echo "${step#plans:}" | tr ',' '\n' | sed 's/^/--/; s/=/ /' | tr '\n' ' ')
      timeout "$(left 10)" python3 bench/matvec_plans.py $flags > "$out/plans.txt" 2>&1
      grep "best\|launch_plan\|DIFFERS\|Error" "$out/plans.txt" | tail -30 ;;
    experts)
      timeout "$(left 10)" python3 bench/expert_plans.py 2>&1 | grep -v "warn" | tail -12 ;;
    kinds*)
      timeout "$(left 10)" python3 bench/step_kinds.py --layers "$(step_n 12)" 2>&1 | grep -v "warnings.warn" | tail -4 ;;
    readback*)
      layers=$(step_n 43)
      timeout "$(left 10)" python3 -m ds4_mlx.cli bench --synthetic q2 --layers "$layers" --ctx-start 2048 \
        --ctx-max 2048 --gen-tokens 32 --read-back --json > "$out/readback.json" 2> "$out/readback.err"
      echo "read back: $(figures "$out/readback.json")" ;;
    file)
      mkdir -p /mnt/ram && (mountpoint -q /mnt/ram || mount -t tmpfs -o size=100g tmpfs /mnt/ram)
      t0=$(date +%s)
      [ -f /mnt/ram/flash.gguf ] || timeout "$(left 200)" python3 -m ds4_mlx.cli make-model --preset flash --repeat --jobs 16 \
        /mnt/ram/flash.gguf --mtp /mnt/ram/flash-mtp.gguf > "$out/make.txt" 2>&1
      echo "files written in $(( $(date +%s) - t0 )) s: $(ls -la /mnt/ram | tail -2 | awk '{print $5, $9}' | tr '\n' ' ')"
      timeout "$(left 10)" python3 -m ds4_mlx.cli bench -m /mnt/ram/flash.gguf --mtp /mnt/ram/flash-mtp.gguf \
        --mtp-draft 3 --ctx-start 2048 --ctx-max 2048 --gen-tokens 32 --json --csv "$out/file.csv" \
        > "$out/file.json" 2> "$out/file.err"
      echo "rc $?"
      grep -iv "warnings.warn\|it/s\]" "$out/file.err" | cut -c1-250 | tail -12
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d)[:2500])" "$out/file.json" 2>&1 | tail -3 ;;
    pressure*)
      IFS=: read -r _ fill layers <<< "$step:"; fill=${fill:-80}; layers=${layers:-28}
      b="python3 -m ds4_mlx.cli bench --synthetic q2 --layers $layers --quiet"
      for case in "free::--ctx-start 12288 --ctx-max 12288 --gen-tokens 16" \
                  "fill:$fill:--ctx-start 12288 --ctx-max 12288 --gen-tokens 16" \
                  "fill-chunk4096:$fill:--ctx-start 12288 --ctx-max 12288 --gen-tokens 16 --prefill-chunk 4096" \
                  "walk-chunk4096::--ctx-start 2048 --ctx-max 8192 --step-mul 2 --gen-tokens 16 --prefill-chunk 4096"; do
        IFS=: read -r label gb flags <<< "$case"
        timeout "$(left 10)" python3 bench/host_pressure.py --fill-gb "${gb:-0}" --label "$label" \
          --json "$out/pressure_$label.json" -- $b $flags > "$out/pressure_$label.txt" 2>&1
        grep -v "warn" "$out/pressure_$label.txt" | grep "│ \|host_pressure" | tail -4
      done ;;
    pressurefile*)
      fill=$(step_n 0)
      mkdir -p /mnt/ram && (mountpoint -q /mnt/ram || mount -t tmpfs -o size=100g tmpfs /mnt/ram)
      [ -f /mnt/ram/flash.gguf ] || timeout "$(left 200)" python3 -m ds4_mlx.cli make-model --preset flash --repeat \
        --jobs 16 /mnt/ram/flash.gguf > "$out/make.txt" 2>&1
      python3 -c "print(open('README.md').read() * 3)" > /tmp/prompt10k.txt
      timeout "$(left 10)" python3 bench/host_pressure.py --fill-gb "$fill" --label run10k --json "$out/pressure_run.json" \
        -- python3 -m ds4_mlx.cli run -m /mnt/ram/flash.gguf --nothink --temp 0 -c 16384 --prompt-file /tmp/prompt10k.txt \
        -n 12 > "$out/pressure_run.txt" 2>&1
      tail -2 "$out/pressure_run.txt"
      timeout "$(left 10)" python3 bench/host_pressure.py --fill-gb "$fill" --label walk --json "$out/pressure_walk.json" \
        -- python3 -m ds4_mlx.cli bench -m /mnt/ram/flash.gguf --prompt-file /tmp/prompt10k.txt --ctx-start 2048 \
        --ctx-max 32768 --step-mul 2 --gen-tokens 64 --quiet > "$out/pressure_walk.txt" 2>&1
      grep -v "warn" "$out/pressure_walk.txt" | grep "│ \|host_pressure" | tail -9 ;;
    chunks*)
      IFS=: read -r _ layers sizes <<< "$step:"; layers=${layers:-12}; sizes=${sizes:-1024,2048,4096}
      for c in $(echo "$sizes" | tr ',' ' '); do
        timeout "$(left 10)" python3 -m ds4_mlx.cli bench --synthetic q2 --layers "$layers" --ctx-start 16384 \
          --ctx-max 16384 --gen-tokens 0 --prefill-chunk "$c" --json > "$out/chunks_$c.json" 2> "$out/chunks_$c.err"
        echo "chunk $c: $(figures "$out/chunks_$c.json")"
      done ;;
    attnplans)
      timeout "$(left 10)" python3 bench/attention_plans.py 2>&1 | grep -v "warnings.warn\|_warn_once\|UserWarning" | tail -24 ;;
    ttft*)
      IFS=: read -r _ layers ctx chunk <<< "$step:"; layers=${layers:-43}; ctx=${ctx:-11520}
      timeout "$(left 10)" python3 -m ds4_mlx.cli bench --synthetic q2 --layers "$layers" --ctx-start "$ctx" \
        --ctx-max "$ctx" --gen-tokens 16 ${chunk:+--prefill-chunk "$chunk"} --json > "$out/ttft.json" 2> "$out/ttft.err"
      echo "$ctx tokens: $(figures "$out/ttft.json"); first token after $(python3 -c "import json,sys; f=json.load(open(sys.argv[1]))['frontiers'][0]; print(round(f['prefill_tokens'] / f['prefill_tps'], 2))" "$out/ttft.json" 2>&1 | tail -1) s of prefill" ;;
    startup*)
      layers=$(step_n 4)
      rm -rf /tmp/ds4cuda-startup
      for tag in cold warm off; do
        cache=/tmp/ds4cuda-startup; [ $tag = off ] && cache=off
        DS4_CUDA_CACHE=$cache timeout "$(left 10)" python3 -m ds4_mlx.cli bench --synthetic q2 --layers "$layers" \
          --ctx-start 2048 --ctx-max 2048 --gen-tokens 8 --json > "$out/startup_$tag.json" 2> "$out/startup_$tag.err"
        echo "$tag: $(figures "$out/startup_$tag.json")"
      done
      echo "cubins: $(ls /tmp/ds4cuda-startup | wc -l)"; grep -h "CudaCache\|Fallback" "$out"/startup_*.err | sort | uniq -c | head ;;
    loadpaths)
      src=/mnt/ram/flash.gguf  # the file step's: real bytes, so each path's check against the file means something
      [ -f $src ] || { src=/dev/shm/z; python3 -c "import numpy as np, sys; b = np.random.default_rng(0).bytes(1 << 26)
with open(sys.argv[1], 'wb') as f: [f.write(b) for _ in range(256)]" $src; }
      for path in pinned memcpy load; do
        timeout "$(left 10)" python3 bench/load_paths.py $src --gb 16 --path $path --threads 8 \
          > "$out/loadpaths_$path.txt" 2>&1
        grep -v "warnings.warn" "$out/loadpaths_$path.txt" | tail -4
      done
      rm -f /dev/shm/z ;;
    knobs*)
      IFS=: read -r _ layers count <<< "$step:"; layers=${layers:-12}; count=${count:-3}
      knobs=("" "MLX_MAX_MB_PER_BUFFER=1000000" "MLX_MAX_MB_PER_BUFFER=1000000 MLX_MAX_OPS_PER_BUFFER=1000")
      for knob in "${knobs[@]:0:$count}"; do
        tag=$(echo "${knob:-defaults}" | tr ' =' '_-')
        env $knob timeout "$(left 10)" python3 -m ds4_mlx.cli bench --synthetic q2 --layers "$layers" --ctx-start 2048 \
          --ctx-max 2048 --gen-tokens 32 --repeats 2 --json > "$out/knobs_$tag.json" 2> "$out/knobs_$tag.err"
        echo "${knob:-defaults}: $(figures "$out/knobs_$tag.json")"
      done ;;
    diff*)
      IFS=: read -r _ layers at <<< "$step:"; layers=${layers:-4}; at=${at:-2048}
      timeout "$(left 5)" python3 bench/graph_diff.py --layers "$layers" --at "$at" 2>&1 | grep -v "warnings.warn" | tail -14 ;;
    replay*)
      IFS=: read -r _ layers at <<< "$step:"; layers=${layers:-43}; at=${at:-2048}
      timeout "$(left 5)" python3 bench/graph_replay.py --layers "$layers" --at "$at" 2>&1 | grep -v "warnings.warn" | tail -12 ;;
    decoder*)
      IFS=: read -r _ layers at <<< "$step:"; layers=${layers:-43}; at=${at:-2048}
      timeout "$(left 5)" python3 bench/graph_decoder.py --layers "$layers" --at "$at" > "$out/decoder$layers.txt" 2>&1
      grep -v "warnings.warn\|it/s\]" "$out/decoder$layers.txt" | cut -c1-160 | tail -60 ;;
    ab:*)
      IFS=: read -r _ dir layers ctx <<< "$step:"; layers=${layers:-43}; ctx=${ctx:-2048}
      for d in "$dir" .; do
        (cd "$d" && PYTHONPATH=$PWD:$PYTHONPATH timeout "$(left 10)" python3 -m ds4_mlx.cli bench --synthetic q2 --layers "$layers" \
          --ctx-start "$ctx" --ctx-max "$ctx" --gen-tokens 128 --json > "$out/ab.json" 2> "$out/ab.err")
        echo "$d: $(figures "$out/ab.json")"
        grep -v "warnings.warn\|it/s\]" "$out/ab.err" | cut -c1-200 | tail -4
      done
      rm -f "$out/ab.json" "$out/ab.err" ;;
    graph*)
      IFS=: read -r _ layers ctx modes <<< "$step:"; layers=${layers:-43}; ctx=${ctx:-2048}; modes=${modes:-off,on}
      for mode in $(echo "$modes" | tr ',' ' '); do
        DS4_GRAPH_DECODE=$mode timeout "$(left 10)" python3 -m ds4_mlx.cli bench --synthetic q2 --layers "$layers" \
          --ctx-start "$ctx" --ctx-max "$ctx" --gen-tokens 128 --json > "$out/graph.json" 2> "$out/graph_$mode.err"
        echo "graph decoding $mode: $(figures "$out/graph.json")"
        grep -v "warnings.warn\|it/s\]" "$out/graph_$mode.err" | cut -c1-300 | tail -4
      done
      rm -f "$out/graph.json" ;;
    attn)
      timeout "$(left 10)" python3 bench/chunk_attention.py 2>&1 | grep -v "warnings.warn" | tail -15 ;;
    mma)
      timeout "$(left 10)" python3 bench/mma_ceiling.py 2>&1 | grep -v "warnings.warn" | tail -5 ;;
    gemms*)
      only=${step#gemms}; only=${only#:}
      timeout "$(left 10)" python3 bench/prefill_gemms.py ${only:+--only $only} 2>&1 | grep -v "warnings.warn" \
        > "$out/gemms.txt"; tail -60 "$out/gemms.txt" ;;
    ncuattn*)
      regexes=${step#ncuattn}; regexes=${regexes#:}; regexes=${regexes:-chunk_attention_tc2_picked,indexer_scores_tc}
      for regex in ${regexes//,/ }; do
        timeout "$(left 30)" /usr/local/cuda/bin/ncu --set full -k "regex:$regex" -c 1 -o /tmp/attn -f \
          python3 bench/chunk_attention.py --calls 1 --repeats 1 > "$out/ncuattn.log" 2>&1; tail -1 "$out/ncuattn.log"
        timeout "$(left 5)" python3 bench/ncu_summary.py /tmp/attn.ncu-rep --listings "$out/sass" >> "$out/ncuattn_summary.txt" 2>&1
      done
      grep -v "^    " "$out/ncuattn_summary.txt" | tail -40 ;;
    ncu*)
      regex=${step#ncu}; regex=${regex#:}; regex=${regex:-ds4_(dense|grouped_(raw|wgmma))}
      timeout "$(left 30)" /usr/local/cuda/bin/ncu --set full -k "regex:$regex" -o /tmp/gemms -f \
        python3 bench/prefill_gemms.py --once > "$out/ncu.log" 2>&1; tail -2 "$out/ncu.log"
      timeout "$(left 5)" python3 bench/ncu_summary.py /tmp/gemms.ncu-rep --listings "$out/sass" > "$out/ncu_summary.txt" 2>&1
      grep -v "^    " "$out/ncu_summary.txt" | tail -40 ;;
    ablate)
      timeout "$(left 10)" python3 bench/gemm_ablate.py 2>&1 | grep -v "warnings.warn" | tail -40 ;;
    *) echo "unknown step $step" ;;
  esac
done
tar -czf "$out/ptx.tgz" -C /tmp/ptx .
echo "== done in $(( $(date +%s) - start )) s"
