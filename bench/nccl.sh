#!/usr/bin/env bash
# The replicate dimension on NCCL inside training runs, on one GPU: every rank poses as a host of its own
# (nccl_rank_per_host). Each pair: a failure-free twin and a kill run side by side, then compare:
# a replicate peer killed mid all-reduce (dense, one-rank groups), a rank killed inside an MoE layer's
# forward (deepseek_v3, EP 2 in 2-rank groups), a replicate peer killed mid-backward (exact mode).
# Then, with SURVIVOR_STEPS > 0, a survivor of a replicate peer's death kept running well past
# TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (shortened to HEARTBEAT_S), once as titan_recover sets NCCL up and once
# with TorchTitan's dump on timeout back on (the preflight's override): the first must live, the second
# shows what the preflight refuses.
#   STEPS=20 bash bench/nccl.sh     # on a GPU machine, TorchTitan's wheels in .whl/ (docs/gpus.md)
# On a CPU the same runs go over gloo. Results on one H200: bench/results/nccl_gpu.txt. Run by bench/gpu_check.sh.
set -u
OUT=${OUT:-/tmp/gpu_out}; DUMPS=${DUMPS:-/tmp/o}; mkdir -p "$OUT" "$DUMPS"
source bench/gpu_env.sh
$PY -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
HOLD="sleep replica=0 step=8 phase=optimizer seconds=120 until=epoch"
JOB_ENV=()  # settings for the next job's environment
job() {
    local name=$1; shift; local t0=$SECONDS
    env "${JOB_ENV[@]}" timeout ${RUN_TIMEOUT:-200} $PY -m titan_recover.launch --job.config_file train_configs/llama3_debug_cpu.toml \
        --metrics.log_freq 10 --training.steps ${STEPS:-20} "${NCCL[@]}" --job.dump_folder $DUMPS/$name "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo $rc > "$OUT/$name.rc"
    echo "== $name rc=$rc $((SECONDS - t0))s"
    grep -a "replicate dimension on\|placement\|GPUs" "$OUT/$name.log" | grep -a launcher | head -2
    grep -a -A14 "^titan_recover summary" "$OUT/$name.log" | grep -a "steps committed\|microbatches\|failures \|replica 1 at\|recovery lat\|rejoined\|param digests\|mean step\|FATAL"
    grep -a "FATAL\|Traceback\|Terminating the process\|signal dumping" "$OUT/$name.log" | head -3
    cp $DUMPS/$name/recover_events.jsonl "$OUT/$name.jsonl" 2>/dev/null
}
pair() {  # name, compare flag, fault, overrides
    local name=$1 cmp=$2 fault=$3; shift 3
    job "${name}_ref" "$@" --recover.fault_plan none > "$OUT/${name}_ref.txt" &
    job "${name}_kill" "$@" --recover.fault_plan "$fault; $HOLD" > "$OUT/${name}_kill.txt" &
    wait
    cat "$OUT/${name}_ref.txt" "$OUT/${name}_kill.txt"
    $PY -m titan_recover.compare $cmp $DUMPS/${name}_ref $DUMPS/${name}_kill 2>&1 | tail -2
}
survivor() {  # name, then settings: replica 1 dies mid all-reduce at step 3, replica 0 goes on without a hold
    local name=$1; shift
    JOB_ENV=(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${HEARTBEAT_S:-30} "$@") STEPS=$SURVIVOR_STEPS RUN_TIMEOUT=${SURVIVOR_TIMEOUT:-300}
    job "$name" "${SINGLE[@]}" --recover.fault_plan "kill replica=1 rank=0 step=3 phase=allreduce"
}
SINGLE=(--parallelism.data_parallel_shard_degree 1)
pair dense "--rel-tol 1e-3" "kill replica=1 rank=0 step=3 phase=allreduce" "${SINGLE[@]}" > "$OUT/p1.txt" 2>&1 &
pair moe_ep2 "--rel-tol 1e-3" "kill replica=1 rank=1 step=3 phase=forward" --model.name deepseek_v3_recover --model.flavor tiny --parallelism.expert_parallel_degree 2 > "$OUT/p2.txt" 2>&1 &
pair exact_dense --exact "kill replica=1 rank=0 step=3 phase=backward" "${SINGLE[@]}" --recover.exact --recover.digest_interval 1 --training.global_batch_size 24 > "$OUT/p3.txt" 2>&1 &
if [ "${SURVIVOR_STEPS:-0}" -gt 0 ]; then
    survivor survivor > "$OUT/p4.txt" 2>&1 &
    survivor survivor_dump_on TITAN_RECOVER_PREFLIGHT=warn TORCH_NCCL_DUMP_ON_TIMEOUT=1 > "$OUT/p5.txt" 2>&1 &
fi
wait
cat "$OUT"/p?.txt
