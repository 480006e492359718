#!/usr/bin/env bash
# Everything that needs the GPU machine, in one call (device tool): tests marked gpu, the benchmarks,
# the agent on real NVML, the preflight canary and the demo on GPUs. Logs go to $OUT (8 files at most).
#   bash bench/gpu_run.sh                    everything
#   ONLY="diag canary demo" NVML=0 bash bench/gpu_run.sh   a subset; NVML=0 runs the agent without NVML
# Needs the wheels in .whl/ (the agent's and the rank library's for python 3.12: bash bench/device_wheels.sh;
# the framework benches' too: bench/framework_wheels.sh), carried to the machine (`carry: [".whl"]`).
set -u
OUT=${OUT:-/tmp/sdcw-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else   # said in the summary: steps needing the agent's wheels (grpc, redis, ...) will fail for that reason
  export PYTHONPATH=$PWD
fi
LOG=$OUT/all.log; SUM=$OUT/summary.txt; : > "$LOG"; : > "$SUM"
ls .whl/*.whl >/dev/null 2>&1 || echo "no wheels in .whl/ (bash bench/device_wheels.sh here, then carry .whl): \
steps that need the agent's packages fail" | tee -a "$SUM"
ONLY=${ONLY:-all}; NVML=${NVML:-1}
want() { [ "$ONLY" = all ] || [[ " $ONLY " == *" $1 "* ]]; }
NVFLAG=(); [ "$NVML" = 0 ] && NVFLAG=(--no-nvml-enabled)
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  local t0=$SECONDS
  echo "===== $name: $*" >> "$LOG"
  timeout "$t" "$@" >> "$LOG" 2>&1; local rc=$?
  printf '%-16s rc=%-4s %5ss\n' "$name" "$rc" "$((SECONDS - t0))" >> "$SUM"
}
mutant() {  # mutant NAME TIMEOUT MUTANT PYTEST-ARGS...: GPU tests in a copy of the tree with bench/mutate.py's
  # MUTANT applied; they must fail there (rc 1)
  local name=$1 t=$2 which=$3; shift 3
  python3 bench/mutate.py /tmp/mut "$which" >> "$LOG" 2>&1 || { printf '%-16s mutant %s did not apply\n' "$name" "$which" >> "$SUM"; return; }
  step "$name" "$t" bash -c 'cd /tmp/mut && PYTHONPATH=/tmp/site:/tmp/mut python3 -m pytest -p no:cacheprovider -q -m gpu \
    -o addopts="" -rA "$@"; echo "mutant rc=$? (must be 1)"' _ "$@"
}
{ date -u; nvidia-smi --query-gpu=name,uuid,pci.bus_id,driver_version,memory.total --format=csv; nproc;
  python3 -c 'import torch, triton, grpc, google.protobuf as p; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "grpc", grpc.__version__, "protobuf", p.__version__, "gpus", torch.cuda.device_count())'; } >> "$LOG" 2>&1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')

want diag && step nvml-diag 150 python3 bench/nvml_diag.py
want fields && [ "$NVML" = 1 ] && step nvml-fields 180 python3 bench/nvml_fields.py --cold-rounds 5 --json "$OUT/nvml_fields.json"
want ckptprof && step ckpt-profile 120 python3 bench/bench_checkpoint.py --profile --mib 2048
# the agent alone on an idle host (AGENT_FG=1), or in the background of the GPU work below
want agentbench && [ "${AGENT_FG:-${FG:-0}}" = 1 ] && step agent-bench 400 python3 bench/bench_agent.py --calls 3000 \
  --rounds "${AGENT_ROUNDS:-3}" --seconds 3 --memory-calls 100000 $([ "$NVML" = 0 ] && echo --no-nvml)
# the same with the canary on (it runs at the agent's start on the idle GPUs): RPC latency while it runs
want agentcanary && step agent-bench-canary 200 python3 bench/bench_agent.py --calls 3000 --rounds 3 --seconds 3 \
  --memory-calls 20000 --with-canary
# CPU-side measurements in the background while the GPU work runs
NVMLB=""; AGENTB=""
# FG=1: the NVML and agent benches run alone, one after the other (an idle host), before the GPU work
if want nvml && [ "$NVML" = 1 ] && [ "${FG:-0}" = 1 ]; then
  step nvml-bench 180 python3 bench/nvml_h200.py --seconds 120 --interval 1 --json "$OUT/nvml.json"
elif want nvml && [ "$NVML" = 1 ]; then
  python3 bench/nvml_h200.py --seconds 60 --interval 1 --json "$OUT/nvml.json" > "$OUT/nvml.log" 2>&1 & NVMLB=$!
fi
if want agentbench && [ "${AGENT_FG:-${FG:-0}}" != 1 ]; then
  python3 bench/bench_agent.py --calls 3000 --rounds 3 --seconds 3 --memory-calls 100000 \
    $([ "$NVML" = 0 ] && echo --no-nvml) > "$OUT/agent_bench.log" 2>&1 & AGENTB=$!
fi
# every test marked gpu in the suite (the ones the CPU suite skips); the Kubernetes tests' client libraries
# are not among the device's wheels, and they have no GPU test
want gpuall && step gpu-all 400 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" -rfE tests/ \
  --ignore=tests/test_k8s_manifests.py --ignore=tests/test_k8s_node_conditions.py --ignore=tests/test_kustomize.py
want tests && step gpu-tests 200 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_fingerprint_gpu.py tests/test_monitor_cuda.py tests/test_canary_gpu.py tests/test_canary_child.py \
  $([ "$NVML" = 1 ] && echo tests/test_nvml_real.py)
want monitor && step monitor-1gpu 80 python3 bench/bench_monitor_overhead.py
want monitor && [ "$NGPU" -ge 2 ] && step monitor-2gpu 100 torchrun --nproc-per-node 2 bench/bench_monitor_overhead.py
want canary && step canary-bench 90 python3 bench/bench_canary.py
want canary && step canary-cli 40 python3 -m daemon.cli canary --level quick
# the full canary suite with each check's time (issue 23: target 12.5 s per GPU), as JSON
want canaryfull && step canary-full 120 bash -c "python3 -m daemon.cli canary --level full --json > $OUT/canary_full.json"
# the loss detector on a clean GPT-2-small run from scratch (issue 22): exit 1 on any warning or critical
want lossclean && step loss-clean 300 python3 -m bench.loss_clean_run --device cuda --steps 600 --csv "$OUT/loss_clean.csv"
# the SM-naming canary: per-SM coverage and a fault placed on SM 17 located (issue 23)
want canarysm && step canary-sm 180 python3 bench/bench_canary_sm.py --fault-sm 17 --json "$OUT/canary_sm.json"
# the agent under the storm scenario: CPU, RSS, health-check latency (fake NVML in the agent: see the script)
want storm && step storm 300 python3 bench/bench_storm.py --seconds 30 --json "$OUT/storm.json"
# the same at a kubelet's 1 check/s (target: under 2% of a core in every scenario)
want storm1 && step storm-1hz 200 python3 bench/bench_storm.py --seconds 20 --check-hz 1 --json "$OUT/storm1.json"
want ckpt && step ckpt-bench 150 python3 bench/bench_checkpoint.py --mib 2048 --tier-mib 512
# issue 21: the copy overlapped with the next forward/backward (a-d at 2 GiB), then part d at 12 GiB
want ckptoverlap && step ckpt-overlap-tests 150 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_checkpoint_overlap.py tests/test_step_guard.py tests/test_checkpoint_source_sums.py
want ckptoverlap && step ckpt-overlap 550 python3 bench/ckpt_overlap.py --checksums source,host --inflight 4
# issue 21 pace: every step pipelined (4 in flight) against one save at a time; first save vs steady
want ckptpipe && step ckpt-pipe-tests 150 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_checkpoint_overlap.py tests/test_checkpoint_source_sums.py
want ckptpipe && step ckpt-pipe 560 python3 bench/ckpt_overlap.py --parts bc --checksums source --inflight 4,2,1 \
  --profile
# the same, short (one device call's budget): batch 16 and 32, 2 and 1 in flight, 3 rounds
want ckptpipe2 && step ckpt-pipe-tests 120 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_checkpoint_overlap.py tests/test_checkpoint_source_sums.py
want ckptpipe2 && step ckpt-pipe2 300 python3 bench/ckpt_overlap.py --parts bc --checksums source --inflight 2,1 \
  --batches 16,32 --rounds 3 --profile
# issue 21: the update's copies enqueued by the copy thread against by save(), 2 in flight; first save vs steady
want ckptq && step ckpt-q-tests 100 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_checkpoint_overlap.py tests/test_checkpoint_source_sums.py
want ckptq && step ckpt-q 300 python3 bench/ckpt_overlap.py --parts bc --checksums source --inflight 2 \
  --copy-thread 1,0 --batches 16,32 --rounds 3 --profile
# ninth session's last call: the GPU tests it touched, every-step checkpoints (copy thread; 2 and 1 in flight),
# first save vs steady, the compute checks' overhead and device time with the swept summary kernel
want final9 && step final9-tests 200 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_checkpoint_overlap.py tests/test_checkpoint_source_sums.py tests/test_checkpoint_slots.py \
  tests/test_grad_summary_gpu.py tests/test_compute_gate_device.py
want final9 && step final9-ckpt 220 python3 bench/ckpt_overlap.py --parts bc --checksums source --inflight 2,1 \
  --batches 16,32 --rounds 3 --profile
want final9 && step final9-compute 170 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --cases none --overhead 100 --block 10 --together --hook-arm --gpu-profile 8
# issue 21 after the tenth session's walk changes: every step, 2 in flight, with the training thread's profile
want ckpt10 && step ckpt10 200 python3 bench/ckpt_overlap.py --parts bc --checksums source --inflight 2 \
  --batches 16,32 --rounds 3 --profile
# issue 21, where batch 16's every-step cost goes: the host's share of a step and the device work a save adds
want ckptdiag && step ckptdiag 300 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 2 \
  --batches 8,16,32 --rounds 6 --profile --diagnose
# issue 21, eleventh session: blocks end on the training's stream (the last save's copy overlaps the next
# step in training); batch 8 with 3 in flight; the first save over steady on 7 fresh clients
want ckpt11 && step ckpt11b 260 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 2 \
  --batches 8,16,32 --rounds 6 --profile
want ckpt11 && step ckpt11b8 90 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 8 --rounds 6
want ckpt11 && step ckpt11c 150 python3 bench/ckpt_overlap.py --parts c --fresh 7 --repeat 4
# issue 21: each timed block led in by an untimed step (every timed step has a save in flight beside it);
# the fingerprint kernel (source) against host hashing, and gathered copies
want ckpt11x && step ckpt11x 300 python3 bench/ckpt_overlap.py --parts b --checksums source,host --inflight 2 \
  --batches 16,32 --rounds 6 --profile
want ckpt11x && step ckpt11g 120 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 2 \
  --gather 256 --batches 16,32 --rounds 6
# issue 21, last of the eleventh session: the checkpoint GPU tests (the short ring's private-buffer path on
# CUDA among them), then every step at batch 16 and 32 over 10 rounds
want ckpt11f && step ckpt11f-tests 150 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_checkpoint_overlap.py tests/test_checkpoint_source_sums.py tests/test_checkpoint_slots.py
want ckpt11f && step ckpt11f 240 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 2 \
  --batches 16,32 --rounds 10 --profile
# issue 21: the update's host waits for the copy thread's enqueue, beside the compute stream's idle time
want ckpt11w && step ckpt11w 200 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 2 \
  --batches 16,32 --rounds 6 --diagnose
# issue 21, next: is the every-step cost's bimodal run-to-run spread (batch 16 +0.5% or +2.1%) the host
# (the device idle while state() + save() run, from an event pair) or the GIL (a 0.2 ms switch interval)?
want ckpt12 && step ckpt12 300 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 2 \
  --batches 16,32 --rounds 6 --switch-interval 0,0.0002
# the rank's CPU a commit on this host: the manifest rendered on the rank against the layout + words
want ckpt12 && step commit-words 120 python3 bench/commit_words.py --commits 100
# issue 21, twelfth session: the GIL switch interval (then the snapshotter's own setting, reverted: no effect),
# 0 here = Python's 5 ms), and 3 in flight against 2 (save -> COMMITTED is the host's lead + copy + commit,
# 1.6 steps at batch 16: 2 in flight skipped 2 of 78)
want ckpt13 && step ckpt13 420 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3,2 \
  --batches 16,32 --rounds 6 --switch-interval 0.0002,0
want ckpt13 && step ckpt13a 150 python3 bench/ckpt_overlap.py --parts a
# issue 21, thirteenth session: batch 16 read +0.8% or +2.3% by mode, whatever the switch interval (ckpt12,
# ckpt13): the same setting five times (3 in flight, Python's interval), two of them with gc.freeze(), the
# collector's pauses per arm and each round's ratio printed: a mode's place in the run, or the collector?
want ckpt14 && step ckpt14 330 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 6 --switch-interval 0 --gc on,on,freeze,on,freeze
# ckpt14: modes 1 and 3 read +2.2-2.3%, 2, 4 and 5 +0.8%, the collector ruled out: the same setting four times
# with the device time of forward+backward and of the optimizer step (its wait for the copies) per arm and the
# save's side stream printed, then again with 32 hardware queues (does the side stream share the training's?)
want ckpt15 && step ckpt15 240 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 6 --switch-interval 0 --gc on,on,on,on
want ckpt15 && CUDA_DEVICE_MAX_CONNECTIONS=32 step ckpt15c 240 python3 bench/ckpt_overlap.py --parts b \
  --checksums source --inflight 3 --batches 16 --rounds 6 --switch-interval 0 --gc on,on,on,on
# ckpt15 (06:05): the same H L H L with 32 queues; in the high modes the forward+backward itself runs
# 1.5 ms longer on the device (the update never waits); high = the side stream from the pool's slots 0 and
# 3, low = 2, 4 (and 5 in ckpt14). ckpt16: the side stream made by the bench for each mode, the pool's
# next slot each time (8 modes at the default priority, then 4 at the higher)
want ckpt16 && step ckpt16 420 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 5 --switch-interval 0 --side-priority=0,0,0,0,0,0,0,0,-1,-1,-1,-1
# ckpt16 (06:11): not the stream: by a mode's place in the run, H L H L L, again and again (ckpt14 too), at
# either priority. What a mode makes anew is its ring of slot files (9 x 1.65 GB of tmpfs, registered):
# ckpt17, the same five modes with the memory dir on a tmpfs mounted huge=always (2 MB pages)
if want ckpt17; then
  cat /sys/kernel/mm/transparent_hugepage/shmem_enabled /sys/kernel/mm/transparent_hugepage/enabled >> "$LOG" 2>&1
  mkdir -p /mnt/sdcw-huge && mount -t tmpfs -o huge=always,size=60G tmpfs /mnt/sdcw-huge >> "$LOG" 2>&1 \
    && SDCW_BENCH_MEM_ROOT=/mnt/sdcw-huge step ckpt17 300 python3 bench/ckpt_overlap.py --parts b \
      --checksums source --inflight 3 --batches 16 --rounds 4 --switch-interval 0 --gc on,on,on,on,on
fi
# ckpt17 (06:20): the mount gave no huge pages (shmem THP "never" on this VM: ShmemHugePages 0), and the same
# H L H L L. Next: ckpt18 profiles the first three modes (H L H; --diagnose: torch.profiler over a block of
# each arm): which kernel runs longer in the first and third (the fingerprint kernel beside the forward, the
# compute kernels, the copies' engine)
want ckpt18 && step ckpt18 330 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 4 --switch-interval 0 --gc on,on,on --diagnose
# and the five modes on one agent and memory dir (each still its own client and slot ring): does the
# pattern follow the node or the client?
want ckpt18 && step ckpt18n 200 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 4 --switch-interval 0 --gc on,on,on,on,on --one-node
# issue 21: rings of staging slots made one after another in one process; per slot the copy alone, forward+
# backward alone and beside the copy, and where its pages are (NUMA, physical runs, 2 MiB share); controls:
# a driver-pinned buffer, anonymous memory with and without transparent huge pages
want place && step place 300 python3 bench/pinned_placement.py --modes 6 --slots 9 --batch 16 --repeat 3
# and five modes of part b with each slot's uses and physical layout (the slow places 1 and 3 against the rest)
want place && step ckpt19 200 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 3 --switch-interval 0 --gc on,on,on,on,on
# the slow places' extra device time split by what ran beside each training kernel (fingerprint kernel, copies,
# nothing), and the kernels that grew most (--diagnose), modes H L H
want ckpt20 && step ckpt20 200 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 3 --switch-interval 0 --gc on,on,on --diagnose
# the fingerprint kernel on an eighth of its CTAs (4 items an SM, default 32): does its share of the SMs decide?
want ckpt20 && SDCWATCH_FP_ITEMS_PER_SM=4 step ckpt20fp 150 python3 bench/ckpt_overlap.py --parts b \
  --checksums source --inflight 3 --batches 16 --rounds 3 --switch-interval 0 --gc on,on,on,on,on
# ckpt20 (09:24): the fingerprint kernel's grid is not it (4 items an SM: H L H L L again). Next, ckpt21: the
# host's CPU per mode (this process, the agent, the whole host) beside the diagnosis's split, now against
# each kernel's own launch shape; and placeload: the copies and the training beside them with host memory
# streamed by 6 threads, against none (does host memory traffic slow the DMA and, through it, the kernels?).
# Part b's device phases now split forward from backward (the copies run beside the forward first)
want ckpt21 && step ckpt21 200 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 3 --switch-interval 0 --gc on,on,on --diagnose
want ckpt21 && step placeload0 100 python3 bench/pinned_placement.py --modes 2 --slots 3 --repeat 3 --anon ''
want ckpt21 && step placeload6 100 python3 bench/pinned_placement.py --modes 2 --slots 3 --repeat 3 --anon '' \
  --host-load 6
# ckpt22 (fifteenth session): does the copy thread decide H or L? Places 1 and 3 (always slow so far) with the
# copies enqueued by save() on the training thread, 2 and 4 with the copy thread; then ckpt21's diagnosis with
# the copies' rows (a save's span against its copy-engine time, a small copy's fixed cost, a large one's rate)
# and the host's launch calls per thread (a launch held in the driver behind the copy thread's grows there)
want ckpt22 && step ckpt22-tests 150 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_checkpoint_overlap.py tests/test_checkpoint_source_sums.py
want ckpt22 && step ckpt22-thread 200 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 3 --switch-interval 0 --copy-thread 0,1,0,1
want ckpt22 && step ckpt22-diag 300 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 3 --switch-interval 0 --gc on,on,on --diagnose
# ckpt22 found the copy thread does not decide it (places 1 and 3 slow either way) and, in a slow mode, a
# large copy at 49.7 GB/s against 54.7: does the stream decide? (torch's pool hands each mode new streams)
want streams && step streams8 150 python3 bench/copy_streams.py --streams 40 --high 4 --repeat 3
want streams && step streams32 150 env CUDA_DEVICE_MAX_CONNECTIONS=32 python3 bench/copy_streams.py --streams 36 \
  --high 0 --repeat 3
want streams && step place-smoke 100 python3 bench/pinned_placement.py --modes 1 --slots 1 --repeat 1 --anon ''
# streams found every pool stream fast (copy beside forward+backward 31.3 ms, any stream, 8 or 32 queues):
# the stream does not decide it either. ckpt23: after each mode, the copy alone into each of its ring's free
# slots (a slow mode's staging memory slow by itself?), and ckpt21's host memory traffic beside the copies
want ckpt23 && step ckpt23 200 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 3 --switch-interval 0 --gc on,on,on,on
want ckpt23 && step placeload0 100 python3 bench/pinned_placement.py --modes 2 --slots 3 --repeat 3 --anon ''
want ckpt23 && step placeload6 100 python3 bench/pinned_placement.py --modes 2 --slots 3 --repeat 3 --anon '' \
  --host-load 6
# ckpt23: every slot fast alone (31.0 ms, slow modes too), host memory traffic slows the copies 5-8%; and all
# four modes slow when one more pool stream was taken a mode (side streams at pool index 0, 3, 5, 7; before:
# 0 H, 2 L, 3 H, 4 L). ckpt24: the side stream at a chosen pool index, two scrambled orders
want ckpt24 && step ckpt24a 260 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 2 --switch-interval 0 --side-index 0,3,2,4,5,6,7,1
want ckpt24 && step ckpt24b 260 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 2 --switch-interval 0 --side-index 5,0,7,3,1,2,6,4
# ckpt24: the pool index does not decide it: in two orders places 1 and 3 were slow (+2.1-2.3%), whatever
# their index, places 2 and 4-8 fast (+0.6-1.0%). ckpt25: the GPU's clocks, PCIe link and traffic, power and
# throttle reasons per arm (NVML), and the caching allocator's segments per mode
want ckpt25 && step ckpt25 200 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 2 --switch-interval 0 --gc on,on,on,on
# ckpt25: clocks (1980/3201 MHz), PCIe gen 5 x16, power and throttle reasons alike in slow and fast modes, but
# in the slow modes' 'every' arm the GPU received 3.6-3.7 GB/s over PCIe (fast: 35 MB/s): the GPU reads host
# memory in a slow mode (page-table walks of the slots' mappings in host memory?). ckpt26: per mode, outside
# the save path, the copies beside a step into one of the mode's slots and into a driver-pinned buffer, with
# the PCIe traffic meanwhile: is it the ring's mapping (slot slow, rx high; pinned fast) or the save path?
want ckpt26 && step ckpt26 200 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 2 --switch-interval 0 --gc on,on,on,on
# ckpt27: the memory dir on a tmpfs of its own mounted huge=always, checked to make huge pages (on this CPU VM,
# kernel 6.18, huge=always makes them although shmem_enabled reads never; ckpt17's 0 was never checked): if a
# slow mode's GPU reads host memory for the translations of 4 KiB pages, 2 MiB pages should make every mode fast
want ckpt27 && step thp-mount 60 bash -c 'mkdir -p /mnt/sdcw-thp && mount -t tmpfs -o huge=always,size=48G none \
  /mnt/sdcw-thp && python3 -c "
import os, mmap
fd = os.open(\"/mnt/sdcw-thp/probe\", os.O_CREAT | os.O_RDWR, 0o600); os.posix_fallocate(fd, 0, 1 << 30)
print([l.strip() for l in open(\"/proc/meminfo\") if l.startswith(\"ShmemHugePages\")]); os.unlink(\"/mnt/sdcw-thp/probe\")"'
want ckpt27 && step ckpt27 200 env SDCW_BENCH_MEM_ROOT=/mnt/sdcw-thp python3 bench/ckpt_overlap.py --parts b \
  --checksums source --inflight 3 --batches 16 --rounds 2 --switch-interval 0 --gc on,on,on,on
# ckpt28 (ckpt26 said: outside the save path a copy into the most used slot beside a step is fast and the GPU
# reads no host memory, in slow modes too): every free slot in turn, and the free slots in rotation as the saves
# take them, each with its PCIe rx: is the host-memory read tied to some slots?
want ckpt28 && step ckpt28 240 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 2 --switch-interval 0 --gc on,on,on,on --beside-every-slot
# ckpt29: the host-checksum path at places 1 (slow) and 2, source checksums at 3 (slow) and 4
want ckpt29 && step ckpt29 200 python3 bench/ckpt_overlap.py --parts b --checksums host,source --inflight 3 \
  --batches 16 --rounds 2 --switch-interval 0 --gc on,on
# ckpt30 (ckpt28: every slot, and the slots in turn, copy fast beside a step in slow modes too, the GPU reading
# no host memory; ckpt18: H L H L L on one agent, so a slow mode goes with its client): after each mode, in its
# client, the save with one part changed at a time (no fingerprint kernels nor words, kernels only, words only, 1 in flight)
want ckpt30 && step ckpt30 300 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 2 --switch-interval 0 --gc on,on,on --toggles all
# ckpt32 (ckpt30: in a slow client its fingerprint kernels make the GPU read host memory while the copies run,
# +1.8% of the step): where does the slow state live? Per mode, after its timed blocks: the previous mode's plan
# borrowed, a new plan, the free slots registered again
want ckpt32 && step ckpt32 300 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 2 --switch-interval 0 --gc on,on,on,on --after-actions borrow,replan,reregister
# ckpt33: outside the save, the copy beside a step into a slot and into driver-pinned memory, each also with the
# client's fingerprint kernels first: do the kernels make a slot copy read host memory and not a driver-pinned one?
want ckpt33 && step ckpt33 240 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16 --rounds 2 --switch-interval 0 --gc on,on,on --beside-fp
# ckpt31 and ckpt34-45 (the kernels after the copies; on streams of the bench's own, waited for or not, timed or
# not; a sweep of torch's pool streams; the product's on a stream of priority -1, then with a join stream) found
# the arrangement that is fast in every client; their arms went with the question (docs/BENCHMARKS.md, the
# seventeenth to nineteenth sessions). ckpt46: the product so (the kernels on a fingerprint stream, the side
# stream waiting for a plain event after them); the save path's GPU tests; the test that the update waits for
# the fingerprints, against a copy of the tree with the update's waits for the save cut out (it must fail there);
# whether a stream waiting on the device polls host memory (wait_poll: it did not, ckpt41); then every step
# against none in four clients, beside the arrangement before (onside) and another fingerprint stream (fplate)
if want ckpt46; then
  # (its GPU tests and the mutant: the ckpttests group, below)
  step wait-poll 60 python3 bench/wait_poll.py --ms 400 --repeat 3
  step ckpt46 300 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
    --batches 16 --rounds 3 --switch-interval 0 --gc on,on,on,on --toggles nofp,onside,fplate
fi
# ckpt47 (ckpt46: no slow client; one client's main rows +1.18% over two rounds, toggled +0.87%): the target's
# run, every step against none at batches 16 and 32, three clients each, four rounds
want ckpt47 && step ckpt47 480 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 3 \
  --batches 16,32 --rounds 4 --switch-interval 0 --gc on,on,on
# the save path's GPU tests with the suite's tmp_path on tmpfs (tests/conftest.py: until the twentieth session it
# was under /tmp, where no slot could be pinned, so those tests copied synchronously), then the mutant (the
# update's waits for the save cut out): both parameters of the fingerprint-wait test must fail under it
want ckpttests && step fs-types 10 bash -c 'uname -r; stat -f -c "%n %T" /tmp /dev/shm'
want ckpttests && step ckpttests 240 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" -rA \
  tests/test_checkpoint_overlap.py tests/test_checkpoint_source_sums.py tests/test_checkpoint_slots.py \
  tests/test_step_guard.py
want ckpttests && mutant ckpttests-mutant 200 update-waits tests/test_checkpoint_source_sums.py \
  tests/test_checkpoint_overlap.py tests/test_step_guard.py
# the first save against a steady one in seven fresh clients with prepare() (one client's ratio moves with the
# spread of a 1 ms save: ckptfirst's one client 1.50x, twentieth session), after the fingerprint stream made ahead
want ckptfresh && step ckptfresh 200 python3 bench/ckpt_overlap.py --parts c --fresh 7 --repeat 4
# the first save against a steady one, after this session's prepare() changes (with the tests they touch)
want ckptfirst && step ckptfirst-tests 120 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_checkpoint_overlap.py tests/test_checkpoint_source_sums.py tests/test_checkpoint_slots.py
want ckptfirst && step ckptfirst 200 python3 bench/ckpt_overlap.py --parts c --repeat 6
# issue 21: gathered copies (a 256 MiB bounce buffer, tens of copies per save) against one copy per tensor
want ckptgather && step ckpt-gather-tests 150 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_checkpoint_overlap.py tests/test_checkpoint_source_sums.py
want ckptgather && step ckpt-gather-cpu-tests 100 python3 -m pytest -p no:cacheprovider -q -o addopts="" \
  tests/test_checkpoint_gather.py
want ckptgather && step ckpt-gather 250 python3 bench/ckpt_overlap.py --parts b --checksums source --inflight 2 \
  --batches 16,32 --rounds 3 --profile --gather 256,0
want ckptoverlap12 && step ckpt-overlap-12g 500 python3 bench/ckpt_overlap.py --parts d --gib 12 --repeat 1
# issue 21 item 6: peer transport streams and cap against a plain TLS/TCP stream (CPU-only; the 16-core host)
want peerstreams && step peer-streams 200 python3 bench/bench_peer_transport.py --mib 1024 --streams 4
want peerstreams && step peer-streams-netns 200 python3 bench/bench_peer_transport.py --mib 1024 --streams 4 \
  --netns --rate-gbit 25
# issue 18: the cost of VERIFIED and of a repair against the save; the replica vote gated on the device
want verify && step verify-cost-1gpu 300 python3 -m bench.verify_cost --device cuda --world 1
want verify && step verify-cost-gloo 300 python3 -m bench.verify_cost --device cuda --world 2 --backend gloo
want verify && [ "$NGPU" -ge 2 ] && step verify-cost-nccl 300 python3 -m bench.verify_cost --device cuda --world 2
# a vote launched before a rollback (still in flight in the ring) masks no redone update (NCCL, 2 GPUs)
want verify && [ "$NGPU" -ge 2 ] && step restore-epoch-nccl 200 python3 -m pytest -p no:cacheprovider -q -m gpu \
  -o addopts="" tests/test_replica_restore_epoch.py
want verify && step agreed-directive 120 torchrun --standalone --nproc-per-node 2 bench/agreed_directive.py \
  --device cuda $([ "$NGPU" -ge 2 ] || echo --backend gloo)
# issue 19 on one GPU: the compute checks' overhead (DDP world 1 on NCCL: real comm hooks; arms base, checks,
# checks + audits every 334, sdcguard every 20th step) and the 12-case subset + smallest fault on virtual ranks
# (sdcguard needs its wheel in .whl/: pip download sdcguard==0.4.0 --no-deps -d .whl)
want compute && step compute-overhead 480 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --cases none --overhead 400 --block 20 --sdcguard 20
want compute && step compute-gpu1 480 python3 -m bench.compute_gpu1 --device cuda --model gpt2 --clean 200 --sdcguard 20
# the same table in about 90 s (--quick: warm-up 12, clean 40, every other sweep size; seconds per phase printed)
want computequick && step compute-gpu1-quick 150 python3 -m bench.compute_gpu1 --device cuda --model gpt2 --quick \
  --sdcguard 20
# issue 19: the hooks' tests alone (the side stream's two events kept, not one made a bucket)
want hooktests && step hook-tests 240 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" -rA \
  tests/test_grad_summary_gpu.py tests/test_compute_gate_device.py
# and under the mutant (the old waits, through torch's wait_stream) the side stream's event count must fail
want hooktests && mutant hook-tests-mutant 120 hook-wait-stream tests/test_compute_gate_device.py -k side_stream
# issue 19: the C++ comm hook (checksums/native_hook.py): built here with the machine's compiler against
# torch's headers, then its GPU tests (its bound launches against the Python hook's rows, masked step and
# weights)
want native && step native-build 300 bash -c 'command -v c++; time python3 -m checksums.native_hook'
want native && step native-tests 300 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" -rA \
  tests/test_native_hook.py tests/test_compute_gate_device.py tests/test_grad_summary_gpu.py
# issue 19: the fused gradient-bucket summary (one read of each bucket) compiled for the GPU against the torch
# path; its time against the torch path and a plain read (1-500 MB, bf16/fp32); the compute checks' overhead
# on GPT-2 small with the fused path ("checks") and the torch path ("checks-torch") side by side
want gradsum && step gradsum-tests 240 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_grad_summary_gpu.py
# issue 19: the summary kernel's launch configuration swept (device time, rows checked against the default's)
want gssweep && step gs-sweep 150 python3 -m bench.bench_grad_summary --device cuda --sweep --sweep-budget 100 \
  --json "$OUT/gs_sweep.json"
want gradsum && step gradsum-bench 300 python3 -m bench.bench_grad_summary --device cuda --json "$OUT/grad_summary.json"
want gradsum && step gradsum-overhead 480 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --cases none --overhead 200 --block 20 --sdcguard 20
# issue 19, everything together on one GPU: the "all" arm (Monitor fingerprint + vote gate, in-job canary,
# checks, audits every 334) beside base/checks/audits/sdcguard, interleaved; then 2,000 clean steps on 3
# virtual ranks (no false suspicion expected)
want computeall && step compute-all 300 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --cases none --overhead 200 --block 10 --sdcguard 20 --together --hook-arm \
  --gpu-profile 8
# the same with 4 micro-batches a step (32k tokens; all but the last under no_sync()): the checks run once a step
want computeaccum && step compute-accum 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --cases none --overhead 80 --block 10 --together --hook-arm --accum 4
# the device path's tests: direct launches, the graph verdict (also under deterministic algorithms)
want computeall && step compute-gate-tests 90 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_compute_gate_device.py
want computegate && step compute-gate-tests 90 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_compute_gate_device.py
# the same, short, with each arm's host time per step and its largest functions (cProfile)
want computeprof && step compute-prof 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --cases none --overhead 40 --block 20 --together --profile 14
# the hook's reduction and the judge on this host's CPU, against their baselines (no GPU)
want computeprof && step gate-host 90 python3 -m bench.gate_host
# where the host waits for the GPU inside a step (CUDA sync debug mode), base / checks / all
want computesync && step compute-sync 150 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --cases none --overhead 20 --block 10 --together --sync-debug
# issue 19: fp16 autocast under a GradScaler (its default 65536: early overflows), GPT-2 small, world 1, an
# audit every 10 steps: every replay exact under the step's scale, no GPU named
want computefp16 && step compute-fp16 240 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --cases none --clean 400 --audit-every 10 --amp fp16
# issue 19: the checks' overhead on a device-bound step (32k tokens in one micro-batch), with each arm's 95%
# interval and the device's busy share; the arm checks-inline runs the summaries on the backward's stream (the default: the hooks' side stream)
(want computebig || want gatetests) && step gate-tests 150 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
  tests/test_compute_gate_device.py
want computebig && step compute-big 330 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --batch 32 --cases none --overhead 150 --block 10 --together --hook-arm \
  --gpu-profile 4
# issue 19: the host time of each piece of the checks' hook, one bucket at a time (stream and event calls, the
# reduction with and without its future, the summary's launch in each form)
want hookhost && step hook-host 120 python3 -m bench.hook_host
# issue 19: a host-bound step (8k tokens): the side stream's host cost against the summaries inline, and the
# host time of each part of each arm (--host-parts)
want compute8 && step compute-8k 320 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --batch 8 --cases none --overhead 200 --block 10 --hook-arm --host-parts 20
# which host operations and CUDA runtime calls each arm adds inside the host-bound step (torch.profiler, CPU):
# where the gate's ~0.7 ms before the update goes in the step when its pieces alone take ~0.15 ms
want hostops && step host-ops 300 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --batch 8 --cases none --overhead 60 --block 10 --hook-arm --host-ops 25
# the same, base and checks only (fits a call on a machine started with little device time left)
want hostops2 && step host-ops-checks 150 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --batch 8 --cases none --overhead 40 --block 10 --arms checks --host-ops 25
# the same with a Python thread computing 20% of the time beside the training (in 1 ms bursts): a Python comm
# hook waits for the GIL a bucket at a time, the C++ hook's bound buckets do not (arms checks / checks-python)
want compute8busy && step compute-8k-busy 320 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m \
  bench.compute_faults --device cuda --world 1 --model gpt2 --batch 8 --cases none --overhead 200 --block 10 \
  --hook-arm --host-parts 20 --busy-thread 0.2
# the 0.2% target resolved: many more rounds of base against checks only (and all together, 32k), for a
# narrow paired interval: 8k tokens host-bound (~55 ms a step), 32k device-bound (~160 ms)
want ci8 && step checks-ci-8k 300 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --batch 8 --cases none --overhead 800 --block 10 --arms checks
# a step the host paces on any host (2k tokens; AB_BATCH=8: 8k), base against checks with each part's host time
# (AB_EXTRA: more arguments, e.g. --gpu-profile 4); with AB_TREE
# (another commit's tree carried beside this one, e.g. `git archive OLD | tar -x -C ab_old`) that tree's run
# alternates with this one's on the same machine: the host work a change cut, measured side by side
hostbound() {  # hostbound NAME TREE
  step "$1" 240 env -C "$2" PYTHONPATH="/tmp/site:$2" CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m \
    bench.compute_faults --device cuda --world 1 --model gpt2 --batch "${AB_BATCH:-2}" --cases none \
    --overhead "${AB_STEPS:-300}" --block 10 --arms checks --host-parts 20 ${AB_EXTRA:-}
}
want hostab && for r in $(seq 1 "${AB_ROUNDS:-2}"); do
  for t in ${AB_TREE:-}; do hostbound "hostbound-$t-$r" "$PWD/$t"; done    # one tree or several
  hostbound "hostbound-$r" "$PWD"
done
want ci32 && step checks-ci-32k 420 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --batch 32 --cases none --overhead 500 --block 10 --together --arms checks,all
# issue 19's "everything together under 1%, interleaved in one run" at GPT-2 small's usual micro-batch (8k tokens):
# base / checks / all (the vote + its gate, the in-job canary, the checks, audits every 334); --gpu-profile: the
# device's busy share beside each arm (whether the host or the device paced the step)
want ci8all && step checks-ci-8k-all 420 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --batch 8 --cases none --overhead 500 --block 10 --together --arms checks,all \
  --gpu-profile 4
# issue 19 on the pair (nvidia-h200-x2; skipped on one GPU): DDP over NCCL, the 12-case subset with sdcguard
# beside it, then 2,000 clean steps; --determinism strict (warn_only=False: under warn_only=True GPT-2's step
# is not repeatable on the H200, and replays fall to the rounding bound: determ-probe, 2026-12-05)
want computepair && [ "$NGPU" -ge 2 ] && step compute-pair 300 env CUBLAS_WORKSPACE_CONFIG=:4096:8 torchrun \
  --standalone --nproc-per-node 2 bench/compute_faults.py --device cuda --model gpt2 --cases h200 --sdcguard 20 --determinism strict
want computepair && [ "$NGPU" -ge 2 ] && step compute-pair-clean 280 env CUBLAS_WORKSPACE_CONFIG=:4096:8 torchrun \
  --standalone --nproc-per-node 2 bench/compute_faults.py --device cuda --model gpt2 --cases none --clean 2000 --determinism strict
# a GPU faulty from the first step (x1.01 on one element of rank 1's forward from step 1): named at step 1
# through the CPU witness (float64 GPT-2 small on the host), replays exact after it (CPU: tests/test_compute_checks.py)
want computepair && [ "$NGPU" -ge 2 ] && step compute-pair-start 240 env CUBLAS_WORKSPACE_CONFIG=:4096:8 torchrun \
  --standalone --nproc-per-node 2 bench/compute_faults.py --device cuda --model gpt2 --fault-step 1 --audit-every 5 --determinism strict \
  --cases "mm one elem x1.01 persistent"
# issue 19: is GPT-2 small's step bit-for-bit repeatable on the H200, under which settings (warn_only=True
# before; strict = warn_only=False, as docs/compute-checks.md tells users; sdpa held to one backend)? Then the
# checks with strict determinism (exact replays expected), and a GPU faulty from step 1 on ranks sharing
# this GPU (gloo over CUDA tensors; 3 ranks: majority, 2 ranks: the CPU witness)
want determ && step determ-probe 150 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.determinism_probe \
  --device cuda --model gpt2 --repeats 4
want determ && step determ-clean 150 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --world 1 --model gpt2 --cases none --clean 100 --audit-every 10 --determinism strict
want determ && step start-3ranks 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 3 --model gpt2 --fault-step 1 --audit-every 5 --determinism strict \
  --cases "mm one elem x1.01 persistent"
want determ && step start-2ranks 240 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 2 --model gpt2 --fault-step 1 --audit-every 5 --determinism strict \
  --cases "mm one elem x1.01 persistent"
# issue 19: the CPU witness on bf16 GPUs: t for a fault and for rounding, per witness (host fp64/fp32/bf16, and
# the GPUs recomputing in fp32); then two ranks on this GPU with the fault from step 1 and from step 40
want witness && step start-2ranks 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 2 --model gpt2 --batch 2 --fault-step 1 --audit-every 5 --determinism strict \
  --cases "mm one elem x1.01 persistent"
want witness && step witness-probe 150 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.witness_probe \
  --device cuda --batch 2
# issue 19: the op witness: a fault only in the bf16 matmuls (a tensor core's), forward and backward, on two
# ranks sharing this GPU, and in its fused attention (the float32 witness's replays agree; the first op where the GPUs part decides);
# a torch.compile'd model's witness replays (eager, float32 exact?); the demo's GPT under strict determinism
want determdemo && step determ-demo 120 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.determinism_probe \
  --device cuda --model demo --settings strict,warn
want opwit && step tc-2ranks 430 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 2 --model gpt2 --batch 2 --fault-step 10 --after 10 --audit-every 5 \
  --determinism strict --cases tc
# the tensor-core attention case alone (its fused attention op's uint64 RNG outputs crossed the op witness's
# exchange only since checksums/rank_transit.py, 2026-12-05)
want opwitattn && step tc-attn-2ranks 150 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 2 --model gpt2 --batch 2 --fault-step 10 --after 10 --audit-every 5 \
  --determinism strict --cases "tc attn one elem x1.05 persistent"
# an MoE router's top-k returning one wrong index on rank 1 (an integer output: the op witness's exact rule)
want opwitmoe && step moe-2ranks 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 2 --model tiny-moe --fault-step 10 --audit-every 5 \
  --determinism strict --cases moe
# issue 19: the MoE experts named by the model (`experts=`) against learnt only: 150 clean steps after the
# router's fault, the device mask; suspicions and lost updates in each (thirtieth session)
want moeclean && step moe-clean 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 2 --model tiny-moe --fault-step 10 --audit-every 5 \
  --determinism strict --cases moe --clean 150
want moeclean && step moe-clean-nohint 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 2 --model tiny-moe --fault-step 10 --audit-every 5 \
  --determinism strict --cases moe --clean 150 --no-experts-hint
want compileprobe && step compile-probe 300 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compile_replay_probe \
  --device cuda --model gpt2 --batch 4
# issue 19: the C++ hook's gather and verdict across processes while the pair is not lent: 3 and 2 ranks
# sharing this GPU over gloo (which gathers CUDA tensors; NCCL needs a GPU a rank), each fault caught on its
# step or by the audit, named and masked with the verdict in the hook, then clean steps; the table says on
# how many steps rank 0's hook gathered and judged
want hookranks && step hook-3ranks 240 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 3 --model tiny-gpt --fault-step 30 --after 12 --audit-every 10 \
  --determinism strict --cases "mm one elem =1e4,grad elem =100,mm one elem x1.01 persistent" --clean 300
want hookranks && step hook-2ranks 240 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 2 --model tiny-gpt --fault-step 30 --after 12 --audit-every 10 \
  --determinism strict --cases "mm one elem =1e4,grad elem =100,mm one elem x1.01 persistent" --clean 300
# the pair's 12-case subset on ranks sharing this GPU (the tiny GPT: GPT-2 small over gloo takes ~3 s a step)
want hookh200 && step hook-h200-3ranks 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 3 --model tiny-gpt --cases h200 --determinism strict
want hookh200 && step hook-h200-2ranks 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 2 --model tiny-gpt --cases h200 --determinism strict --fault-step 45
# the same hook path over 5,000 clean steps a world (audits every 10): no false suspicion across processes
want hookclean && step hook-clean-3ranks 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 3 --model tiny-gpt --cases none --audit-every 10 --determinism strict \
  --clean 5000
want hookclean && step hook-clean-2ranks 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 2 --model tiny-gpt --cases none --audit-every 10 --determinism strict \
  --clean 5000
# a convolutional model (BatchNorm, dropout) on ranks sharing this GPU over gloo, then the same with real
# SyncBatchNorm (a collective in the forward: no replay reproduces a step, said at attach; the statistics
# still run): faults on rank 1 at step 30 (an audit step), 200 clean steps
want syncbn && step syncbn-test 150 python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" -rA \
  tests/test_compute_checks.py -k syncbatchnorm
want syncbn && step cnn-3ranks 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 3 --model cnn --fault-step 30 --after 6 --audit-every 10 \
  --determinism strict --cases "mm one elem =1e4,grad elem =100,grad elem NaN,mm one elem x1.01 persistent" --clean 200
want syncbn && step syncbn-3ranks 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 3 --model cnn --sync-bn --fault-step 30 --after 6 --audit-every 10 \
  --determinism strict --cases "mm one elem =1e4,grad elem =100,grad elem NaN,mm one elem x1.01 persistent" --clean 200
# the convolutional model's whole matrix on 3 ranks sharing this GPU, then clean steps under strict
# determinism and under warn_only (the rounding bound: what a job that does not ask for determinism gets)
want cnnmore && step cnn-all-3ranks 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 3 --model cnn --fault-step 30 --after 6 --audit-every 10 \
  --determinism strict --cases all
want cnnmore && step cnn-clean-strict 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 3 --model cnn --cases none --audit-every 10 --determinism strict --clean 5000
want cnnmore && step cnn-clean-warn 200 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 3 --model cnn --cases none --audit-every 10 --clean 2000
# torch's own context parallelism (bench/cp_attention.py api "torch": `_ContextParallel` on each block's SDPA
# as torchtitan applies it) under FSDP2 over (dp, cp) flattened, ranks sharing this GPU over gloo (NCCL takes
# one rank a GPU): dp 3 x cp 2, faults on rank 3 (cp group [2, 3]) from step 22, audits every 5, clean steps;
# then the cp dim not named "cp" and not passed (replays must turn off, no GPU blamed). --cp-rotate alltoall:
# torch 2.11's default all-gather rotation segfaults over gloo on CUDA tensors (in its ring attention, 12-07)
want cptorch && step cp-torch 300 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 6 --fsdp --cp 2 --cp-api torch --cp-rotate alltoall --model tiny-gpt --fault-rank 3 \
  --fault-step 22 --after 6 --audit-every 5 --determinism strict \
  --cases "grad elem =100,mm one elem x1.01 persistent,mm one elem =1e4,grad elem NaN" --clean 200
# the whole fault matrix under torch's CP (dp 3 x cp 2), step 42 (not audited) and 45 (audited)
want cptorchall && step cp-torch-all42 280 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 6 --fsdp --cp 2 --cp-api torch --cp-rotate alltoall --model tiny-gpt \
  --fault-rank 3 --fault-step 42 --audit-every 5 --determinism strict --cases all
want cptorchall && step cp-torch-all45 280 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 6 --fsdp --cp 2 --cp-api torch --cp-rotate alltoall --model tiny-gpt \
  --fault-rank 3 --fault-step 45 --audit-every 5 --determinism strict --cases all
# the lane witness under torch's CP: faults inside block 0's bf16 MLP matmul on rank 3 (the GPU alone named) and
# one a hook adds after it (the group named, one_of)
want cplane && step cp-torch-lane 300 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 6 --fsdp --cp 2 --cp-api torch --cp-rotate alltoall --model tiny-gpt \
  --fault-rank 3 --fault-step 22 --after 6 --audit-every 5 --determinism strict \
  --cases "tc one elem x1.05 persistent,tc channel x2 persistent,mm one elem x1.01 persistent"
# the lane witness under tensor parallelism (the trace hands a DTensor's op back to DTensor's dispatch, so the
# local matmuls are traced): dp 3 x tp 2 (the MLP), and dp 3 x cp 2 x tp 2 under torch's CP (12 ranks on this
# GPU); torch's CP on meshes unflattened from one world mesh (newer torchtitan), the cp dim found by name
# (tp-lane: SIGSEGV on torch 2.11 in DTensor's all-gather over gloo on CUDA, the MLP's last layer gathering
# its output, 2026-12-07; the GPT's tp split, cp-torch-tp-lane, has no all-gather)
want tplane && step tp-lane 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 6 --fsdp --tp 2 --cpu-autocast --fault-rank 3 --fault-step 22 \
  --after 6 --audit-every 5 --determinism strict \
  --cases "tc one elem x1.05 persistent,tc channel x2 persistent,mm one elem x1.01 persistent"
want tplane && step cp-torch-tp-lane 400 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 12 --fsdp --cp 2 --tp 2 --cp-api torch --cp-rotate alltoall \
  --model tiny-gpt --fault-rank 5 --fault-step 22 --after 6 --audit-every 5 --determinism strict \
  --cases "tc one elem x1.05 persistent,tc channel x2 persistent"
want tplane && step cp-torch-unflatten 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 \
  python3 -m bench.compute_faults --device cuda --backend gloo --world 6 --fsdp --cp 2 --cp-api torch \
  --cp-rotate alltoall --cp-mesh unflatten --model tiny-gpt --fault-rank 3 --fault-step 22 --after 6 \
  --audit-every 5 --determinism strict \
  --cases "grad elem =100,mm one elem x1.01 persistent" --clean 50
# expert parallelism (bench.ep_moe, torchtitan's stacked experts as DTensors over ep, found by the dim's
# name):
# dp 3 x ep 2, faults inside rank 3's experts, 50 clean steps
want tplane && step ep-dtensor 300 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 6 --fsdp --model tiny-moe --ep 2 --ep-style dtensor --fault-rank 3 \
  --fault-step 22 --after 6 --audit-every 5 --determinism strict \
  --cases "grad elem =100,tc channel x2 persistent,mm one elem x1.01 persistent" --clean 50
# pipeline parallelism (bench.pp_stages: torch's PipelineStage and ScheduleGPipe, FSDP2 in each stage): the
# ranks share one GPU over gloo (its point-to-point of CUDA tensors is what this tries)
want pp && step pp-cuda 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 4 --fsdp --pp 2 --fault-rank 3 --fault-step 22 --after 6 \
  --audit-every 5 --determinism strict --cases "grad elem =100,mm one elem x1.01 persistent" --clean 50
want cptorch && step cp-torch-tp 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 8 --fsdp --cp 2 --tp 2 --cp-api torch --cp-rotate alltoall --model tiny-gpt \
  --fault-rank 5 --fault-step 22 --after 6 --audit-every 5 --determinism strict --cases "grad elem =100" --clean 50
want cptorch && step cp-torch-unnamed 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m bench.compute_faults \
  --device cuda --backend gloo --world 4 --fsdp --cp 2 --cp-api torch --cp-rotate alltoall --cp-pass none --model tiny-gpt \
  --fault-rank 3 --fault-step 22 --after 6 --audit-every 5 --determinism strict --cases "grad elem =100" --clean 50
want computeclean && step compute-clean 330 python3 -m bench.compute_gpu1 --device cuda --model gpt2 \
  --cases none --no-sweep --clean 2000
# the training-framework callbacks (issue 25): HF Trainer and Lightning vs the same training without sdcwatch,
# GPT-2 small from a config (offline); needs the wheels of bench/framework_wheels.sh in .whl/
want frameworks && step frameworks 580 python3 -m bench.bench_frameworks --device cuda
# torchtitan's own Trainer with SdcwatchCheckpointer (issue 25): overhead against torchtitan's own checkpointer
# off, resume from the agent bit for bit, a flip on 2 GPUs rolled back; needs torchtitan's wheels
# (bench/framework_wheels.sh)
want titan && step titan 580 python3 -m bench.torchtitan_trainer --device cuda --rounds 2
# issue 19, FSDP2 on 2 GPUs (NCCL): collective replays and audits (every rank audited per audit step), faults
# on rank 1 from step 42 (audits every 5; the x1.01 persistent one needs the CPU witness: a float64 GPT-2 on
# the host, slow), 300 clean steps, and the audits' overhead at the default cadence (334) in interleaved blocks
want computefsdp && [ "$NGPU" -ge 2 ] && step compute-fsdp 600 env CUBLAS_WORKSPACE_CONFIG=:4096:8 torchrun \
  --standalone --nproc-per-node 2 bench/compute_faults.py --device cuda --fsdp --model gpt2 --audit-every 5 \
  --fault-step 42 --cases "mm one elem =1e4,mm one elem x1.01 persistent,mm channel x2 persistent,grad elem NaN" \
  --clean 300 --overhead 400 --block 20 --overhead-audit-every 334
# FSDP2 under the device mask (fused Adam on DTensor shards: what mask="auto" picks on CUDA), the same faults
# (on the CPU: the host veto's weights bit for bit, tests/test_compute_checks.py)
want computefsdp && [ "$NGPU" -ge 2 ] && step compute-fsdp-mask 400 env CUBLAS_WORKSPACE_CONFIG=:4096:8 torchrun \
  --standalone --nproc-per-node 2 bench/compute_faults.py --device cuda --fsdp --model gpt2 --audit-every 5 \
  --mask device --fault-step 42 --cases "mm one elem =1e4,mm one elem x1.01 persistent,grad elem NaN" --clean 100
# the op witness on FSDP2's collective replays (NCCL on 2 GPUs; the tensor-core cases, no witness_model)
want computefsdp && [ "$NGPU" -ge 2 ] && step tc-fsdp 420 env CUBLAS_WORKSPACE_CONFIG=:4096:8 torchrun \
  --standalone --nproc-per-node 2 bench/compute_faults.py --device cuda --fsdp --model gpt2 --batch 2 \
  --fault-step 10 --audit-every 5 --determinism strict --cases tc --no-witness-model
want multirank && [ "$NGPU" -ge 2 ] && step multi-rank 200 torchrun --standalone --nproc-per-node "$NGPU" \
  --max-restarts 1 bench/multi_rank.py --out "$OUT/multi_rank.json"
# the agent's RSS after one canary round, and whether it maps libtorch (it must not: issue 17)
want agentrss && step agent-rss-canary 400 python3 bench/agent_rss.py --timeout 360 --json "$OUT/agent_rss.json" \
  $([ "$NVML" = 0 ] && echo --no-canary)
# the agent on real NVML
S=/tmp/sdcw-gpu-agent; rm -rf $S
python3 -m daemon.cli run --state-dir $S --metrics-listen 127.0.0.1:0 "${NVFLAG[@]}" > "$OUT/agent.log" 2>&1 &
A=$!; for i in $(seq 1 100); do [ -S $S/agent.sock ] && break; sleep 0.1; done; sleep "${AGENT_WAIT:-3}"
step agent-rss 5 bash -c "grep -E 'VmRSS|VmHWM' /proc/$A/status; ps -o pid,ppid,rss,etime,args --ppid $A"
step agent-status 20 python3 -m daemon.cli status --socket $S/agent.sock
step agent-status-j 20 python3 -m daemon.cli status --socket $S/agent.sock --json
want demo && [ "$NGPU" -ge 2 ] && step demo-2gpu 150 python3 -m daemon.cli demo --device cuda --ranks 2 --steps 300 \
  --socket $S/agent.sock --out "$OUT/demo" --quiet
kill -TERM $A; wait $A
[ -n "$NVMLB" ] && wait $NVMLB; [ -n "$AGENTB" ] && wait $AGENTB
[ -f "$OUT/nvml.log" ] && { echo "===== nvml bench" >> "$LOG"; cat "$OUT/nvml.log" >> "$LOG"; }
[ -f "$OUT/agent_bench.log" ] && { echo "===== agent bench" >> "$LOG"; cat "$OUT/agent_bench.log" >> "$LOG"; }
echo "===== agent log (tail)" >> "$LOG"; tail -40 "$OUT/agent.log" >> "$LOG"
[ -f "$OUT/demo/summary.json" ] && cp "$OUT/demo/summary.json" "$OUT/demo_summary.json"
[ -f "$OUT/demo/loss.png" ] && cp "$OUT/demo/loss.png" "$OUT/demo_loss.png"
[ -d "$OUT/demo" ] && { for f in "$OUT"/demo/rank*.log; do echo "===== $f (tail)" >> "$LOG"; tail -15 "$f" >> "$LOG"; done; }
rm -rf "$OUT/demo" "$OUT/nvml.log" "$OUT/agent_bench.log"
cat "$SUM"
