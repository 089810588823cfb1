#!/usr/bin/env bash
# The replicate dimension on NCCL inside training runs, on one GPU: every rank poses as a host of its own
# (nccl_rank_per_host). Each case: a failure-free twin and a kill run side by side, then compare:
# a replicate peer killed mid all-reduce (dense, one-rank groups), a rank killed inside an MoE layer's
# forward (deepseek_v3, EP 2 in 2-rank groups), a replicate peer killed mid-backward (exact mode).
#   STEPS=20 bash bench/nccl.sh     # on a GPU machine, TorchTitan's wheels in .whl/ (docs/gpus.md)
# On a CPU the same runs go over gloo. Results on one H200: bench/results/nccl_gpu.txt.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT" /tmp/o
if [ -d .whl ] && python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD; PY=python3
    NCCL=(--recover.nccl_rank_per_host --recover.replicate_backend nccl)
else
    PY=${PY:-.venv/bin/python}; NCCL=()
fi
export PYTHONUNBUFFERED=1
$PY -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
HOLD="sleep replica=0 step=8 phase=optimizer seconds=120 until=epoch"
job() {
    local name=$1; shift; local t0=$SECONDS
    timeout ${RUN_TIMEOUT:-200} $PY -m titan_recover.launch --job.config_file train_configs/llama3_debug_cpu.toml \
        --metrics.log_freq 10 --training.steps ${STEPS:-20} "${NCCL[@]}" --job.dump_folder /tmp/o/$name "$@" > "$OUT/$name.log" 2>&1
    echo "== $name rc=$? $((SECONDS - t0))s"
    grep -a "replicate dimension on\|placement\|GPUs" "$OUT/$name.log" | grep -a launcher | head -2
    grep -a -A14 "^titan_recover summary" "$OUT/$name.log" | grep -a "steps committed\|microbatches\|failures \|replica 1 at\|recovery lat\|rejoined\|param digests\|mean step\|FATAL"
    grep -a "FATAL\|Traceback" "$OUT/$name.log" | head -3
    cp /tmp/o/$name/recover_events.jsonl "$OUT/$name.jsonl" 2>/dev/null
}
pair() {  # name, compare flag, fault, overrides
    local name=$1 cmp=$2 fault=$3; shift 3
    job "${name}_ref" "$@" --recover.fault_plan none > "$OUT/${name}_ref.txt" &
    job "${name}_kill" "$@" --recover.fault_plan "$fault; $HOLD" > "$OUT/${name}_kill.txt" &
    wait
    cat "$OUT/${name}_ref.txt" "$OUT/${name}_kill.txt"
    $PY -m titan_recover.compare $cmp /tmp/o/${name}_ref /tmp/o/${name}_kill 2>&1 | tail -2
}
SINGLE=(--parallelism.data_parallel_shard_degree 1)
pair dense "--rel-tol 1e-3" "kill replica=1 rank=0 step=3 phase=allreduce" "${SINGLE[@]}" > "$OUT/p1.txt" 2>&1 &
pair moe_ep2 "--rel-tol 1e-3" "kill replica=1 rank=1 step=3 phase=forward" --model.name deepseek_v3_recover --model.flavor tiny --parallelism.expert_parallel_degree 2 > "$OUT/p2.txt" 2>&1 &
pair exact_dense --exact "kill replica=1 rank=0 step=3 phase=backward" "${SINGLE[@]}" --recover.exact --recover.digest_interval 1 --training.global_batch_size 24 > "$OUT/p3.txt" 2>&1 &
wait
cat "$OUT/p1.txt" "$OUT/p2.txt" "$OUT/p3.txt"
