#!/usr/bin/env bash
# Runs a titan_recover training job, TorchTitan style:
#   CONFIG_FILE=./train_configs/llama3_debug_cpu.toml ./run_train.sh [--section.key value ...]   (TorchTitan 0.2.2)
#   TORCHTITAN=0.3.0 RECIPE=llama3_debug_cpu ./run_train.sh [--section.key value ...]           (TorchTitan 0.3.0)
#   ./run_train.sh --check [--section.key value ...]   what the run would do on this node, or what stops it; trains nothing
# Creates the line's environment (./.venv, ./.venv-0.3.0) with the pinned packages on first use, without the
# test tools (EXTRAS=none; ./run_tests.sh adds them to the same environment).
# With a GPU and no config named, the default job is sized for it: 200 steps logged every 10, one rank per
# replica group (any GPU count), the kill at step 5 on rank 0, so the restarted group rejoins in the run
# (it needs ~20 s to start; a GPU step of the debug model takes ~0.2 s). Flags given here still win.
set -euo pipefail
cd "$(dirname "$0")"
EXTRAS=${EXTRAS:-none} source ./scripts/bootstrap.sh
sized=()
if [ -z "${CONFIG_FILE:-}${RECIPE:-}" ] && "$VENV/bin/python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2> /dev/null; then
    sized=(--training.steps 200 --metrics.log_freq 10 --parallelism.data_parallel_shard_degree 1
           --recover.fault_plan "kill replica=1 rank=0 step=5 phase=backward")
    echo "[run_train] a GPU is present: the default job runs sized for it (${sized[*]})" >&2
fi
set -- "${sized[@]}" "$@"
if [ "$TORCHTITAN" = 0.3.0 ]; then  # Python configs: RECIPE=<a function of titan_recover.recipes>
    exec "$VENV/bin/python" -m titan_recover.launch --module titan_recover.recipes --config "${RECIPE:-llama3_debug_cpu}" "$@"
fi
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/llama3_debug_cpu.toml"}
exec "$VENV/bin/python" -m titan_recover.launch --job.config_file "$CONFIG_FILE" "$@"
