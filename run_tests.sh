#!/usr/bin/env bash
# Runs the test suite (real processes, real SIGKILLs): ./run_tests.sh [pytest args]
# Creates ./.venv with the pinned packages on first use.
set -euo pipefail
cd "$(dirname "$0")"
source ./scripts/bootstrap.sh
# the network-namespace cluster's tests drop packets with nftables; as root, install it (Debian's package)
if [ "$(id -u)" = 0 ] && ! command -v nft > /dev/null && command -v apt-get > /dev/null; then
    echo "[bootstrap] installing nftables for the network-namespace tests (log: $VENV/apt.log)" >&2
    export DEBIAN_FRONTEND=noninteractive
    { timeout 120 apt-get install -y -q nftables || { timeout 120 apt-get update -q && timeout 120 apt-get install -y -q nftables; }; } \
        > "$VENV/apt.log" 2>&1 || echo "[bootstrap] nftables could not be installed: those tests skip (see $VENV/apt.log)" >&2
fi
exec "$VENV/bin/python" -m pytest "$@"
