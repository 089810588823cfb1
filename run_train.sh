#!/usr/bin/env bash
# Runs a titan_recover training job, TorchTitan style:
#   CONFIG_FILE=./train_configs/llama3_debug_cpu.toml ./run_train.sh [--section.key value ...]
# Creates ./.venv with the pinned packages on first use.
set -euo pipefail
cd "$(dirname "$0")"
source ./scripts/bootstrap.sh
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/llama3_debug_cpu.toml"}
exec "$VENV/bin/python" -m titan_recover.launch --job.config_file "$CONFIG_FILE" "$@"
