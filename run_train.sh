#!/usr/bin/env bash
# Runs a titan_recover training job, TorchTitan style:
#   CONFIG_FILE=./train_configs/llama3_debug_cpu.toml ./run_train.sh [--section.key value ...]   (TorchTitan 0.2.2)
#   TORCHTITAN=0.3.0 RECIPE=llama3_debug_cpu ./run_train.sh [--section.key value ...]           (TorchTitan 0.3.0)
# Creates the line's environment (./.venv, ./.venv-0.3.0) with the pinned packages on first use.
set -euo pipefail
cd "$(dirname "$0")"
source ./scripts/bootstrap.sh
if [ "$TORCHTITAN" = 0.3.0 ]; then  # Python configs: RECIPE=<a function of titan_recover.recipes>
    exec "$VENV/bin/python" -m titan_recover.launch --module titan_recover.recipes --config "${RECIPE:-llama3_debug_cpu}" "$@"
fi
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/llama3_debug_cpu.toml"}
exec "$VENV/bin/python" -m titan_recover.launch --job.config_file "$CONFIG_FILE" "$@"
