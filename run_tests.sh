#!/usr/bin/env bash
# Runs the test suite (real processes, real SIGKILLs): ./run_tests.sh [pytest args]
# Creates ./.venv with the pinned packages on first use.
set -euo pipefail
cd "$(dirname "$0")"
source ./scripts/bootstrap.sh
exec "$VENV/bin/python" -m pytest "$@"
