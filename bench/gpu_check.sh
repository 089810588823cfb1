#!/usr/bin/env bash
# The prepared GPU check (docs/gpus.md): one command, about 8 minutes on one GPU with torch preinstalled and
# no network (TorchTitan's wheels carried in .whl/, the prepared data/ beside them), everything it measured
# written under one folder. On a CPU it runs the same parts over gloo, one after another (the rehearsal: about
# 25 minutes on 2 cores).
#   bash bench/gpu_check.sh [FOLDER]     # FOLDER: default $OUT where set (the device machine), else /tmp/gpu_check
# Parts (side by side on a GPU):
#   the node self-test (titan_recover.selftest: the collectives probe with SIGKILL mid all-reduce and mid state
#     transfer and a SIGSTOP, every phase timed and memory back; the default job's kill and rejoin; exact mode)
#   bench/nccl.sh's three kill pairs with their twins, and a survivor of a replicate peer's death committing
#     past a shortened TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (beside it the same with the dump on timeout back on)
#   bench.exact_ops (exact mode's cost, one long microbatch length on a GPU, a short one on a CPU)
#   bench/nccl_repro.py (on a GPU only: ProcessGroupNCCL's three behaviours alone, before and after)
# then bench.gpu_check's verdicts (summary.json) and the logs packed (logs.tar.gz): at most 8 files in FOLDER.
set -u
cd "$(dirname "$0")/.."
FOLDER=$(realpath -m "${1:-${OUT:-/tmp/gpu_check}}")
WORK=$(mktemp -d /tmp/gpu_check_work.XXXXXX)
LOGS=$FOLDER/logs
rm -rf "$LOGS" "$FOLDER/logs.tar.gz"; mkdir -p "$LOGS"
source bench/gpu_env.sh
HEARTBEAT_S=${HEARTBEAT_S:-30}
if [ "$ON_GPU" = 1 ]; then
    LIMIT_S=${LIMIT_S:-450} SURVIVOR_STEPS=${SURVIVOR_STEPS:-240} SEQ_LEN=2048 BG='&'  # each part's bound
else
    LIMIT_S=${LIMIT_S:-1200} SURVIVOR_STEPS=${SURVIVOR_STEPS:-40} SEQ_LEN=128 BG=''
fi
part() {  # a part, in the background on a GPU
    if [ -n "$BG" ]; then "$@" & else "$@"; fi
}
t0=$SECONDS
$PY -c "import torch, platform; print('torch', torch.__version__, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu', 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None, 'python', platform.python_version())" | tee "$LOGS/host.txt"
echo "[gpu_check] parts started; results in $FOLDER (work in $WORK)"
part timeout $LIMIT_S $PY -m titan_recover.selftest --out "$FOLDER/selftest.json" --work "$WORK/selftest" > "$LOGS/selftest.txt" 2>&1
part env OUT=$LOGS/nccl DUMPS=$WORK/nccl STEPS=20 SURVIVOR_STEPS=$SURVIVOR_STEPS HEARTBEAT_S=$HEARTBEAT_S \
    RUN_TIMEOUT=$((LIMIT_S - 60)) SURVIVOR_TIMEOUT=$((LIMIT_S - 30)) timeout $LIMIT_S bash bench/nccl.sh > "$LOGS/nccl.txt" 2>&1
part env BENCH_RESULTS=$FOLDER timeout $LIMIT_S $PY -m bench.exact_ops --seq-lens $SEQ_LEN --pairs 1 > "$LOGS/exact_ops.txt" 2>&1
if [ "$ON_GPU" = 1 ]; then
    part timeout $LIMIT_S python3 bench/nccl_repro.py > "$LOGS/nccl_repro.txt" 2>&1
else
    echo "no GPU: ProcessGroupNCCL's reproduction needs one" > "$LOGS/nccl_repro.txt"
fi
wait
echo "[gpu_check] parts done in $((SECONDS - t0))s"
$PY -m bench.gpu_check "$FOLDER" --heartbeat-s "$HEARTBEAT_S" 2>&1 | tee "$FOLDER/summary.txt"
verdict=${PIPESTATUS[0]}
tar czf "$FOLDER/logs.tar.gz" -C "$FOLDER" logs && rm -rf "$LOGS"
rm -rf "$WORK"
echo "[gpu_check] $((SECONDS - t0))s in all; $(ls "$FOLDER" | tr '\n' ' ')"
exit $verdict
