#!/bin/bash
# One command that measures dllm_fast on a machine with an NVIDIA GPU: build, the CUDA tests, the cross-device
# checks, the fused head against naive PyTorch and the Triton peers (Cut Cross-Entropy, Liger), the official
# samplers, losses and d1's step beside dllm_fast (bench_peers, from .gpu/peers/), the Triton head's kernel
# against torch.mm on the same shapes with its tile sweep, rollouts and the
# engine at LLaDA-8B shapes, the fused ops' GEMM efficiency, the below-precision share of d(logits). Steps run in
# priority order, each under its own time cap, so that a short run still returns the first ones; the whole run
# stays under its limit (default 520 s: give the command about 40 s more than that, under 9 minutes in all).
#
#   bash benchmarks/gpu_run.sh [SECONDS] [WHEEL_DIR]        # from anywhere; it runs in the project's root
#   GPU_RUN_STEPS="engine train8b" bash benchmarks/gpu_run.sh 300   # only those steps (after the build)
#
# WHEEL_DIR (or $DLLM_FAST_PEER_WHEELS; default .gpu/whl): the peers' wheels (cut_cross_entropy, liger_kernel),
# installed offline into a temporary folder; they are not part of the project. A missing peer is left out.
# Nothing is downloaded: the machine needs torch with CUDA, nvcc, pytest and Triton (without a CUDA device it refuses
# before any step, exit 3). A failed step makes the exit status 1; the later steps still run.
# Results: $OUT/log.txt (everything printed; the GPU, driver, torch and commit first), $OUT/res.tgz (JSON and
# logs, packed after every step) and a stripped $OUT/_C.so. OUT defaults to the project's gpu-out/ (ignored by git).
# Keep each benchmark's flags here in step with its argparse (python_tests/test_gpu_run.py checks them).
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-$ROOT/gpu-out}; mkdir -p "$OUT"
WHEELS=${2:-${DLLM_FAST_PEER_WHEELS:-$ROOT/.gpu/whl}}
S=$(date +%s); DEADLINE=$(( S + ${1:-520} ))
t() { echo "=== [$(( $(date +%s) - S ))s] $*"; }
# A step runs when GPU_RUN_STEPS is unset or names it (to rerun the steps a short run missed).
STEPS=" tests smoke peers triton rollout profile train8b train8bmerged engine roofline dlogits attention lorarollout "
STEPS+="sdar8b "
STEPS+="gatherrollout "
for step in ${GPU_RUN_STEPS:-}; do
  [[ $STEPS == *" $step "* ]] || { echo "GPU_RUN_STEPS: no step '$step'; the steps are:$STEPS"; exit 2; }
done
want() { [ -z "${GPU_RUN_STEPS:-}" ] || [[ " $GPU_RUN_STEPS " == *" $1 "* ]]; }
# The time a step may take: its own cap, or what is left before the deadline (less a margin to pack results).
cap() { local l=$(( DEADLINE - $(date +%s) - 8 )); [ "$1" -lt "$l" ] && echo "$1" || echo $(( l > 1 ? l : 1 )); }
WORK=$(mktemp -d); RES=$WORK/res; mkdir -p "$RES"
pack() { tar czf "$OUT/res.tgz" -C "$WORK" res 2>/dev/null; }
# record STEP RC: a command that failed, or ran past its cap (rc 124), makes the run's exit status non-zero; the
# later steps still run, and the failures are listed at the end.
FAILED=""
record() { [ "$2" = 0 ] || { echo "$1 failed (rc=$2)"; FAILED+=" $1(rc=$2)"; }; }
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONPATH=$ROOT

t "dllm_fast GPU run, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 | head -1)"
# Every step measures on CUDA: without a device each would fail after the build, so refuse before any of them.
# No driver node and no nvidia-smi settles it at once (before torch is imported); otherwise torch must see one.
if ! ls /dev/nvidia[0-9]* >/dev/null 2>&1 && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_run.sh needs a CUDA device: this machine has no NVIDIA device (no /dev/nvidia0, no nvidia-smi)"; exit 3
fi
echo "torch: $(python3 -c 'import torch,sys;print(torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0])' 2>&1)"
echo "commit: $(git log -1 --format='%H %s' 2>/dev/null || echo 'not a git checkout')$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
echo "cpus: $(nproc)"

# torch must see a CUDA device (checked before any step, as below).
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_run.sh needs a CUDA device: torch ($(python3 -c 'import torch; print(torch.__version__)' 2>&1 | tail -1))" \
    "sees none (torch.cuda.is_available() is False)"; exit 3
fi

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$WHEELS"/*.whl \
    && export PYTHONPATH=$ROOT:$WORK/site
else
  echo "no peer wheels in $WHEELS: the peer comparison runs dllm_fast and naive only"
fi

t build
if ! python3 -c "import dllm_fast, sys; sys.exit(0 if dllm_fast.build_info().get('with_cuda') else 1)" 2>/dev/null; then
  source .ci/cuda_env.sh python3 || echo "cuda_env.sh failed"
  ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)
  export MAX_JOBS=$(nproc) TORCH_CUDA_ARCH_LIST=${ARCH:-9.0} DLLM_FAST_CUDA=1
  timeout "$(cap 200)" python3 setup.py build_ext --inplace > "$RES/build.log" 2>&1; rc=$?; echo "build rc=$rc"
  record build $rc
  tail -3 "$RES/build.log"
fi
python3 -c "import dllm_fast, sys; info = dllm_fast.build_info(); print(info); sys.exit(0 if info.get('with_cuda') else 1)" \
  || { echo "no step can run: dllm_fast's extension does not import with CUDA (see $RES/build.log)"; pack; exit 1; }
strip --strip-debug -o "$OUT/_C.so" dllm_fast/_C*.so 2>/dev/null

if want tests; then
t tests
timeout "$(cap 70)" python3 -m pytest python_tests -q -rfE --tb=short -p no:cacheprovider -k "cuda and not emulated" \
  > "$RES/tests.log" 2>&1
rc=$?; echo "tests rc=$rc"; record tests $rc; tail -4 "$RES/tests.log"; pack
fi

if want smoke; then
t smoke
timeout "$(cap 110)" python3 benchmarks/gpu_smoke.py "$RES"; record smoke "${PIPESTATUS[0]}"; pack
fi

if want peers; then
t peers
# The compiled head (dllm_*) and the Triton one (triton*, issue 38) side by side; about 30 s of Triton compiling.
timeout "$(cap 110)" python3 benchmarks/peers_logprob.py "$RES/peers_logprob.json" 2048 8192; record peers-logprob "${PIPESTATUS[0]}"; pack
# Issue 38 item 1: the official samplers (LLaDA, Fast-dLLM, SDAR), losses (d1, SPG, ESPO) and d1's step beside
# dllm_fast at LLaDA-8B / SDAR-8B shapes, from the files of their checkouts in .gpu/peers/ (made on the CPU by
# benchmarks/pack_peers.sh DIR); the head's peers are the line above. Rows are written after each kind.
PEERS_DIR=${DLLM_FAST_PEERS:-$ROOT/.gpu/peers}
if [ -d "$PEERS_DIR" ]; then
  timeout "$(cap 240)" python3 benchmarks/bench_peers.py --peers "$PEERS_DIR" --preset 8b --device cuda \
    --kinds rollout update step --results-dir "$RES" 2>&1 | grep -v -i "warn\|usdt" | tail -24; record peers-bench "${PIPESTATUS[0]}"; pack
else
  echo "no peers in $PEERS_DIR (bash benchmarks/pack_peers.sh DIR makes it): bench_peers skipped"
fi
fi

if want triton; then
t triton
# Issue 38 item 2: the Triton kernel (logits GEMM with the softmax in its epilogue) against torch.mm on the same
# chunk shapes (vs_mm_same: the issue's 90%), for every sm_90 tile configuration (--triton-sweep: pick the
# default from it), and the Triton walk, frozen walk, forward and backward beside the compiled ones and mm3 (the
# three GEMMs' floor), at M = 8192 and the chunks both paths default to.
timeout "$(cap 150)" python3 benchmarks/bench_logprob.py --device cuda --roofline --triton-sweep --m 8192 \
  --chunks 16384 --repeats 5 --results-dir "$RES" 2>&1 | tail -34; record triton "${PIPESTATUS[0]}"; pack
fi

if want rollout; then
t rollout
timeout "$(cap 170)" python3 benchmarks/bench_rollout.py --device cuda --batch 8 \
  --providers "dllm_fast dual" "compiled dual" --results-dir "$RES" 2>&1 | grep -v -i warn | tail -6; record rollout "${PIPESTATUS[0]}"; pack
fi

if want profile; then
t profile
# Where a dual-cache denoising step at LLaDA-8B shapes spends the GPU, eager and compiled: kernels by kind.
for mode in "" --compile; do
  timeout "$(cap 100)" python3 benchmarks/profile_rollout.py --device cuda $mode --results-dir "$RES" 2>&1 \
    | grep -v -i "warn\|usdt" | tail -24; record profile$mode "${PIPESTATUS[0]}"
done
pack
fi

# The 8B LoRA step's settings (GPU run 3's), shared by the train8b steps and their plans.
STEP_FLAGS=(--model llada-8b --tokenizer "$RES/llada_vocab" --lora true --lora-rank 128 --task synthetic
  --task-options '{"prompt_length": 200}' --prompts-per-step 4 --group-size 8 --gen-length 256 --block-length 32
  --diffusion-steps 128 --cache dual --temperature 1.0 --micro-batch 31)

if want train8b; then
t train8b
# Issue 29 item 5: whole LLaDA-8B LoRA training steps (random weights; LLaDA-8B's 126,464-row output layer through
# a character tokenizer padded with reserved tokens; a synthetic reward that differs within groups). metrics.jsonl
# holds rollout tokens/s, update pairs/s, compile_seconds and each phase's peak memory; the plan beside it. Step 1
# compiles the LoRA model's denoising step (the 2026-11-26 run's 150 s cap ended inside it), step 2 is the steady one.
python3 -m dllm_fast.assets.char_tokenizer --vocab-size 126464 --out "$RES/llada_vocab" >/dev/null; record train8b-vocab "${PIPESTATUS[0]}"
timeout "$(cap 60)" python3 -m dllm_fast plan "${STEP_FLAGS[@]}" --gpu h200 --search false > "$RES/train8b_plan.txt" 2>&1; record train8b-plan "${PIPESTATUS[0]}"
timeout "$(cap 280)" python3 -m dllm_fast train "${STEP_FLAGS[@]}" --steps 2 --eval-every 1000 --eval-examples 8 \
  --eval-gen-lengths 32 --checkpoint-every 1000 --plot false --output-dir "$RES/train8b" --overwrite true 2>&1 | tail -6; record train8b "${PIPESTATUS[0]}"
rm -rf "$RES/llada_vocab" "$RES/train8b"/checkpoint* 2>/dev/null
pack
fi

if want train8bmerged; then
t train8bmerged
# Issue 38 item 4: the same step rolling out through merged adapters (--lora-merge-rollouts true: one GEMM a
# projection, a 14 GB copy of the adapted weights), its plan beside it; compare with train8b's metrics.jsonl.
python3 -m dllm_fast.assets.char_tokenizer --vocab-size 126464 --out "$RES/llada_vocab" >/dev/null; record train8bmerged-vocab "${PIPESTATUS[0]}"
timeout "$(cap 60)" python3 -m dllm_fast plan "${STEP_FLAGS[@]}" --lora-merge-rollouts true --gpu h200 --search false \
  > "$RES/train8bmerged_plan.txt" 2>&1; record train8bmerged-plan "${PIPESTATUS[0]}"
timeout "$(cap 280)" python3 -m dllm_fast train "${STEP_FLAGS[@]}" --lora-merge-rollouts true --steps 2 \
  --eval-every 1000 --eval-examples 8 --eval-gen-lengths 32 --checkpoint-every 1000 --plot false \
  --output-dir "$RES/train8bmerged" --overwrite true 2>&1 | tail -6; record train8bmerged "${PIPESTATUS[0]}"
rm -rf "$RES/llada_vocab" "$RES/train8bmerged"/checkpoint* 2>/dev/null
pack
fi

if want engine; then
t engine
# Issue 29 item 4: two_pass against naive at equal pairs per graph and at the fitted micro-batch (bench_elbo's
# CUDA defaults: LLaDA-8B, prompt 200, completion 512), LoRA r128 on q, k, v and up.
timeout "$(cap 120)" python3 benchmarks/bench_elbo.py --device cuda --lora --nt 1 16 --micro-batch equal fitted \
  --repeats 1 --providers naive two_pass --results-dir "$RES" 2>&1 | tail -8; record engine "${PIPESTATUS[0]}"; pack
fi

if want roofline; then
t roofline
timeout "$(cap 60)" python3 benchmarks/bench_logprob.py --device cuda --roofline --m 2048 8192 --results-dir "$RES" \
  2>&1 | tail -12; record roofline "${PIPESTATUS[0]}"; pack
fi

if want dlogits; then
t dlogits
# Issue 28 item 3: how much of d(logits) a below-precision block skip could drop, on the `small` preset trained
# 300 steps of masked-diffusion SFT here (seconds on a GPU, hours on 2 cores). The docstring corpus and its BPE
# come from $DLOGITS_CACHE (made on the CPU by the same script: the machine's own packages would give another
# corpus); without it the step is skipped.
DLOGITS_CACHE=${DLOGITS_CACHE:-$ROOT/.gpu/dlogits_cache}
if [ -f "$DLOGITS_CACHE/ids.pt" ]; then
  timeout "$(cap 120)" python3 benchmarks/measure_dlogits_blocks.py --model small --device cuda --train-steps 300 \
    --measure-every 50 --cache-dir "$DLOGITS_CACHE" --results-dir "$RES" 2>&1 | grep "^{" | cut -c1-400; record dlogits "${PIPESTATUS[0]}"; pack
else
  echo "no corpus in $DLOGITS_CACHE (python benchmarks/measure_dlogits_blocks.py --model small --train-steps 0 makes it)"
fi
fi

if want attention; then
t attention
# Issue 38 item 3: a dual-cache step's attention call (batch 8, 32 heads, 32 queries against 456 cached keys, D
# 128, bf16; 0.97 ms of the compiled step's 13.3 busy ms in run 4) by SDPA backend, on the cache's strided views
# and on contiguous copies, and flash split in two along the keys (twice the thread blocks): which to pick.
timeout "$(cap 60)" python3 benchmarks/bench_attention.py --device cuda --batch 8 32 --results-dir "$RES" 2>&1 \
  | grep -v -i warn | tail -24; record attention "${PIPESTATUS[0]}"; pack
fi

if want lorarollout; then
t lorarollout
# Issue 38 item 4: what LoRA's adapters cost a compiled dual rollout at the 8B step's batch of 32 (r128 on every
# projection, fp32 on the bf16 base, bf16 autocast, as train rolls out): against the same rollout without them,
# which is what rolling out with merged adapters would cost. Two fresh processes, each compiling (about 100 s).
for rank in 0 128; do
  timeout "$(cap 200)" python3 benchmarks/bench_rollout.py --device cuda --batch 32 --providers "compiled dual" \
    --lora-rank $rank --results-dir "$RES/lora$rank" 2>&1 | grep -v -i warn | tail -3; record lorarollout$rank "${PIPESTATUS[0]}"
done
pack
fi

if want sdar8b; then
t sdar8b
# Issue 38 item 3: SDAR-8B-shaped block rollouts (random bf16 weights, all 36 layers; batch 8, prompt 200, gen 256,
# blocks of 4, 4 steps a block: the official generate's defaults), eager and compiled (one CUDA graph a step). The
# official block_diffusion_generate at the same shapes is bench_peers.py's SDAR provider (the peers step).
timeout "$(cap 240)" python3 benchmarks/bench_block_rollout.py --device cuda --dtype bfloat16 --preset sdar-8b \
  --layers 36 --batch 8 --prompt 200 --gen 256 --block 4 --steps-per-block 4 \
  --providers "dllm_fast block" "compiled block" --results-dir "$RES" 2>&1 | grep -v -i warn | tail -4; record sdar8b "${PIPESTATUS[0]}"; pack
fi

if want gatherrollout; then
t gatherrollout
# Issue 46: an FSDP2 rollout at LLaDA-8B shapes (fp32 master weights, bf16 gathers) on its per-forward gathers
# against the gather-once copy (train/rollout_weights.py) and the plain model; on one GPU FSDP2's gathers are the
# casts and copies into each unit's unsharded weights that an all-gather would make. Eager rollouts (about 60 s).
timeout "$(cap 150)" python3 benchmarks/bench_gather_rollout.py --device cuda --repeats 2 --results-dir "$RES" 2>&1 \
  | grep -v -i warn | tail -5; record gatherrollout "${PIPESTATUS[0]}"; pack
fi

t done
if [ -n "$FAILED" ]; then echo "failed steps:$FAILED"; exit 1; fi
