#!/usr/bin/env bash
# The GPU check: the GPU path (Triton kernels, CUDA graphs) tested and timed on a real GPU, in one call of
# at most ten minutes:
#   1. the Triton kernel tests (and the engine's backend-equality and CUDA graph tests) on CUDA, against the
#      textbook and eager decoding;
#   2. kvserve bench attention --device cuda (Triton kernels vs torch SDPA: TFLOP/s, GB/s; its --plot needs
#      matplotlib, from the bench extra);
#   3. decode throughput of a random Llama-3.2-1B-shaped model in bf16, 1 and 256 concurrent requests
#      of 512 prompt + 256 output tokens, kvserve vs transformers generate, in the same run.
# Everything lands in $OUT (default ./gpu-check). The project runs from the source tree, so a GPU machine
# without a package index needs no install; pytest and hypothesis come from $GPU_CHECK_DEPS when given
# (a `pip install --target DIR pytest hypothesis` carried along).
#
# Dry run on a CPU (tiny shapes, Triton under its interpreter): GPU_CHECK_DRY=1 scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${GPU_CHECK_DEPS:+:$GPU_CHECK_DEPS}${PYTHONPATH:+:$PYTHONPATH}"
DRY=${GPU_CHECK_DRY:-0}
status=0

step() {   # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, keep going on failure
    local name=$1 limit=$2
    shift 2
    # a dry run checks the script, not its time: on a busy CPU the interpreter may take longer (0: no limit)
    [ "$DRY" = 1 ] && limit=0
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
    [ $rc -eq 0 ] || status=1
}

: > "$OUT/summary.txt"
{ nvidia-smi 2>&1 || echo "no nvidia-smi"; python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.is_available())"; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1
    DEVICE=cpu
    ATTN_ARGS=(--dtype float32 --prefill-lengths 80 --decode-lengths 80 --repeats 1)
    SHAPE=(--hidden-size 128 --intermediate-size 256 --num-layers 2 --num-heads 4 --num-kv-heads 2 --vocab-size 512)
    LOAD=(--requests 4 --prompt-len 32 --tokens 8 --batch1-prompt-len 32 --batch1-tokens 32 --repeats 1 --dtype float32
          --quick --no-sweep)
    TESTS=(tests/attention/test_triton_attention.py -k "mixed_decodes_and_fresh_prefills")
else
    DEVICE=cuda
    ATTN_ARGS=(--dtype bfloat16 --heads 32 --kv-heads 8 --head-dim 128 --repeats 3)
    SHAPE=(--hidden-size 2048 --intermediate-size 8192 --num-layers 16 --num-heads 32 --num-kv-heads 8 --vocab-size 128256)
    LOAD=(--requests 256 --prompt-len 512 --tokens 256 --batch1-prompt-len 512 --batch1-tokens 256 --repeats 1 --dtype bfloat16)
    TESTS=(tests/attention/test_triton_attention.py tests/attention/test_triton_quant.py tests/engine/test_engine.py
           tests/engine/test_gpu_memory.py tests/kernels/test_cuda_graphs.py -k "triton or backend or gpu or graph or eager or cuda")
fi

step kernels 200 python -m pytest -q -x -p no:cacheprovider "${TESTS[@]}"
step attention 120 python -m kvserve.cli bench attention --device "$DEVICE" "${ATTN_ARGS[@]}" \
    --json "$OUT/attention.json" --plot "$OUT/attention.png"
step throughput 240 python -m kvserve.cli bench throughput --device "$DEVICE" --attention-backend auto "${SHAPE[@]}" \
    "${LOAD[@]}" --decode-batches none --json "$OUT/throughput.json"
exit $status
