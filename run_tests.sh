#!/usr/bin/env bash
# Runs the test suite (real processes, real SIGKILLs): ./run_tests.sh [pytest args]
# Creates ./.venv with the pinned packages on first use.
set -euo pipefail
cd "$(dirname "$0")"
source ./scripts/bootstrap.sh
# Debian packages some tests drive, installed where this runs as root (the tests that need one skip, saying why,
# where it cannot be had): nftables drops packets in the network-namespace cluster's tests, chromium renders the
# status page headless, Slurm (with munge) runs the batch script on a real cluster of namespace nodes, etcd 3.4.23
# (Debian's; 3.5.0-3.5.3 have etcd-io/etcd#13766) serves the tests' control stores
install_as_root() {  # command it provides, package(s)
    local command=$1
    shift
    if [ "$(id -u)" = 0 ] && ! command -v "$command" > /dev/null && command -v apt-get > /dev/null; then
        echo "[bootstrap] installing $* for the tests (log: $VENV/apt.log)" >&2
        export DEBIAN_FRONTEND=noninteractive
        { timeout 300 apt-get install -y -q "$@" || { timeout 120 apt-get update -q && timeout 300 apt-get install -y -q "$@"; }; } \
            >> "$VENV/apt.log" 2>&1 || echo "[bootstrap] $* could not be installed: the tests that need it skip (see $VENV/apt.log)" >&2
    fi
}
install_as_root nft nftables
install_as_root chromium chromium
install_as_root slurmctld slurmctld slurmd slurm-client munge
install_as_root etcd etcd-server etcd-client
exec "$VENV/bin/python" -m pytest "$@"
