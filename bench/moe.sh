#!/usr/bin/env bash
# MoE jobs under a kill: each family's tiny flavor (and qwen3's debugmodel_moe) with a rank SIGKILLed
# mid-backward at step 3 and its group rejoined (the survivor holds at step 8), against its failure-free
# twin run beside it, and deepseek_v3 in exact mode (the twin's bits). Two single-rank groups per run.
#   STEPS=20 bash bench/moe.sh                       # on a GPU machine: python3 with torch, and TorchTitan's
#                                                    # wheels in .whl/ (see docs/gpus.md), logs in $OUT
#   WAVE2=qwen3_recover:tiny_moe OUT=/tmp/moe bash bench/moe.sh   # on a CPU, from a checkout's .venv
# On a CPU debugmodel_moe takes minutes a step. Results on one H200: bench/results/moe_gpu.txt (from
# before gpt_oss's router bias was initialized: docs/torchtitan-lines.md).
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT" /tmp/o
source bench/gpu_env.sh
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
BASE=(--job.config_file train_configs/llama3_debug_cpu.toml --parallelism.data_parallel_shard_degree 1 --metrics.log_freq 10)
HOLD="sleep replica=0 step=8 seconds=120 until=epoch"   # the survivor waits for the rejoin: it happens in every run
job() {  # name, then overrides
    local name=$1; shift
    local t0=$SECONDS
    timeout ${RUN_TIMEOUT:-240} $PY -m titan_recover.launch "${BASE[@]}" --job.dump_folder /tmp/o/$name "$@" > "$OUT/$name.log" 2>&1
    echo "== $name rc=$? $((SECONDS - t0))s"
    grep -a -A14 "^titan_recover summary" "$OUT/$name.log" | grep -a "steps committed\|microbatches\|recovery lat\|rejoined\|param digests\|mean step\|final loss\|FATAL"
    cp /tmp/o/$name/recover_events.jsonl "$OUT/$name.jsonl" 2>/dev/null
}
pair() {  # name, model name, flavor, extra overrides: a twin and a kill+rejoin, side by side
    local name=$1 model=$2 flavor=$3; shift 3
    local m=(--model.name "$model" --model.flavor "$flavor" --training.steps ${STEPS:-20} "$@")
    job "${name}_ref" "${m[@]}" --recover.fault_plan none > "$OUT/${name}_ref.txt" &
    job "${name}_kill" "${m[@]}" --recover.fault_plan "kill replica=1 rank=0 step=3 phase=backward; $HOLD" > "$OUT/${name}_kill.txt" &
    wait
    cat "$OUT/${name}_ref.txt" "$OUT/${name}_kill.txt"
    $PY -m titan_recover.compare ${COMPARE:---rel-tol 1e-3} /tmp/o/${name}_ref /tmp/o/${name}_kill 2>&1 | tail -3
}
wave() {  # pairs side by side, reported in order
    for f in "$@"; do pair "${f/:/_}" "${f%%:*}" "${f##*:}" > "$OUT/pair_${f/:/_}.txt" 2>&1 & done
    wait
    for f in "$@"; do cat "$OUT/pair_${f/:/_}.txt"; done
}
wave ${WAVE1:-deepseek_v3_recover:tiny llama4_recover:tiny qwen3_recover:tiny_moe}
wave ${WAVE2:-gpt_oss_recover:tiny qwen3_recover:debugmodel_moe} &
COMPARE=--exact pair exact_deepseek deepseek_v3_recover tiny --recover.exact --recover.digest_interval 1 --training.global_batch_size 24
wait
