#!/usr/bin/env bash
# One node's titan_recover launcher in a cluster run: the one place that says what node i runs.
# Used by scripts/slurm/train.sbatch (under srun, and for its plan and DRY_RUN) and by the
# Kubernetes pods of scripts/k8s/train-indexed-job.yaml.
#
#   NODE_INDEX=1 NUM_NODES=2 COORDINATOR_ADDR=node0:29510 CONFIG_FILE=train_configs/X.toml \
#   TITAN_RECOVER_SECRET=... scripts/node.sh [--section.key value ...]
#
# Input (environment):
#   NODE_INDEX        this node, 0..NUM_NODES-1; unset under srun: the position of $SLURMD_NODENAME
#                     in NODE_LIST (the allocation's hosts, first host first)
#   NUM_NODES         nodes in the run (default: the words in NODE_LIST)
#   COORDINATOR_ADDR  host:port of the coordinator, which node 0's launcher starts on that port
#   GROUPS_PER_NODE   replica groups per node, G (default 1): node i runs ids i*G .. i*G+G-1
#   GROUP_NODES       nodes one replica group spans, K (default 1; --recover.group_nodes): nodes form
#                     blocks of K in a row, block b = i / K runs ids b*G .. b*G+G-1 and node i runs part
#                     i % K of each ($TITAN_RECOVER_GROUP_NODE); NUM_NODES must be a multiple of K
#   SPARES            hot spares (default 0): the last SPARES ids. Every id is a group, so
#                     data_parallel_replicate_degree = NUM_NODES / K * G - SPARES, passed below (it and
#                     recover.spares override the config file's values)
#   COORDINATOR_BIND  where node 0's coordinator listens (default 0.0.0.0, every interface; prefer its
#                     address on the private cluster network: see docs/trust-model.md)
#   CONTROL_STORE     etcd://host:port,host:port,host:port of an etcd cluster (3+ members) for coordinator
#                     fail-over (--recover.control_store): every node's launcher runs a coordinator
#                     candidate and the run survives the loss of any node; COORDINATOR_ADDR and
#                     COORDINATOR_BIND are then not used. nodes://host,host,host (3 or 5 of the
#                     job's nodes): the same on an etcd the launchers on those nodes run themselves
#   CONFIG_FILE, TITAN_RECOVER_SECRET   the run's config and its secret, the same on every node
#   TITAN_RECOVER_RUN_ID  the run's id, the same on every node (required with CONTROL_STORE): a node
#                     started again with the same id (a replaced pod) rejoins the run; a new id is a
#                     new run, which never reads an earlier run's state. The batch script passes
#                     $SLURM_JOB_ID, the Kubernetes manifest the Job's uid
#   JOIN_RUN          host:port of a running run's coordinator (TCPStore), or etcd://host:port,... of its
#                     control store (a run on etcd; nodes:// runs print theirs), that this job's nodes join, each
#                     asking for GROUPS_PER_NODE free replica ids (TITAN_RECOVER_REPLICAS=any:G): a lost
#                     node's ids, or new ones up to the run's recover.max_replicas. No node starts a
#                     coordinator; pass the running run's layout as arguments
#                     (--parallelism.data_parallel_replicate_degree R, and --recover.spares, --recover.max_replicas
#                     where it has them), its TITAN_RECOVER_SECRET and TITAN_RECOVER_RUN_ID
#   TITAN_RECOVER_FAILURE_DOMAIN  this node's failure domain (a rack, a leaf switch), passed on as it is; unset
#                     under Slurm's topology/tree plugin: SLURM_TOPOLOGY_ADDR up to the node name (its leaf
#                     switch's path); unset elsewhere: unknown (docs/host-memory.md#failure-domains)
#   NODE_GPUS         what the plan line says of the node's GPUs (the batch script sets it where it counted them)
#   PLAN_ONLY=1       print the node's command and exit (SHOW_SECRET=1 prints the secret too; else
#                     it is shown as <hidden>, e.g. in a Slurm log); unset: print it, then run it
#
# The command is ./run_train.sh, which a single-node user runs: it checks ./.venv against
# pyproject.toml (a no-op once bootstrapped), sets PYTHONUNBUFFERED so each node's log streams, and
# turns CONFIG_FILE into --job.config_file for `python -m titan_recover.launch`. Exit status: the
# launcher's (0-5, each with what a scheduler does on it: docs/multi-node.md#the-scheduler-contract), or 2
# for bad input here. Under Slurm it sources scripts/slurm/node_slurm.sh, which acts on a lost batch host.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

fail() { echo "error: [node.sh] $*" >&2; exit 2; }
is_count() { [[ $1 =~ ^[0-9]+$ ]]; }
quote() {  # words as a shell reads them back: plain when safe, else printf %q
    local w out=""
    for w in "$@"; do
        if [[ $w =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=" $w"; else out+=" $(printf %q "$w")"; fi
    done
    echo "${out# }"
}

NODE_NAME=${NODE_NAME:-${SLURMD_NODENAME:-$HOSTNAME}}
read -ra hosts <<< "${NODE_LIST:-}"
if [ -z "${NODE_INDEX:-}" ]; then
    [ -n "${SLURMD_NODENAME:-}" ] && [ ${#hosts[@]} -gt 0 ] \
        || fail "NODE_INDEX is not set: set it to this node's index (0 for the coordinator's node), or run under srun with NODE_LIST"
    for i in "${!hosts[@]}"; do
        if [ "${hosts[$i]}" = "$SLURMD_NODENAME" ]; then NODE_INDEX=$i; break; fi
    done
    [ -n "${NODE_INDEX:-}" ] || fail "this node ($SLURMD_NODENAME) is not in NODE_LIST=\"${NODE_LIST}\": run it on the allocation's nodes"
fi
NUM_NODES=${NUM_NODES:-${#hosts[@]}}
GROUPS_PER_NODE=${GROUPS_PER_NODE:-1}
GROUP_NODES=${GROUP_NODES:-1}
SPARES=${SPARES:-0}
COORDINATOR_BIND=${COORDINATOR_BIND:-0.0.0.0}
for var in NODE_INDEX NUM_NODES GROUPS_PER_NODE GROUP_NODES SPARES; do
    is_count "${!var}" || fail "$var=${!var} must be a non-negative integer"
done
[ "$NUM_NODES" -ge 1 ] || fail "NUM_NODES=$NUM_NODES: a run has at least one node"
[ "$NODE_INDEX" -lt "$NUM_NODES" ] || fail "NODE_INDEX=$NODE_INDEX is out of range 0..$((NUM_NODES - 1)) (NUM_NODES=$NUM_NODES)"
[ "$GROUPS_PER_NODE" -ge 1 ] || fail "GROUPS_PER_NODE=$GROUPS_PER_NODE: every node runs at least one replica group; set it to 1 or more"
[ "$GROUP_NODES" -ge 1 ] && [ $((NUM_NODES % GROUP_NODES)) -eq 0 ] \
    || fail "GROUP_NODES=$GROUP_NODES must be >= 1 and divide NUM_NODES=$NUM_NODES: every replica group spans that many whole nodes"
ids=$((NUM_NODES / GROUP_NODES * GROUPS_PER_NODE))
replicate=$((ids - SPARES))
[ "$replicate" -ge 1 ] || fail "$NUM_NODES nodes / GROUP_NODES=$GROUP_NODES x GROUPS_PER_NODE=$GROUPS_PER_NODE = $ids replica ids leave no member after SPARES=$SPARES: lower SPARES"
CONTROL_STORE=${CONTROL_STORE:-}
addr=${COORDINATOR_ADDR:-}
port=${addr##*:}
if [ -n "$CONTROL_STORE" ]; then
    [[ $CONTROL_STORE == etcd://?* || $CONTROL_STORE == nodes://?* ]] \
        || fail "CONTROL_STORE='$CONTROL_STORE' must be etcd://host:port,host:port,host:port or nodes://host,host,host"
elif [ -z "${JOIN_RUN:-}" ]; then  # a joining node reaches the run through JOIN_RUN alone
    [[ $addr == ?*:* ]] && is_count "$port" && [ "$port" -ge 1 ] && [ "$port" -le 65535 ] \
        || fail "COORDINATOR_ADDR='$addr' is not host:port (port 1..65535): set it to the first node's host and a fixed port"
fi
[ -n "${CONFIG_FILE:-}" ] && [ -f "$CONFIG_FILE" ] \
    || fail "config file '${CONFIG_FILE:-}' not found (paths are relative to the repository root $PWD): set CONFIG_FILE"
[ -n "${TITAN_RECOVER_SECRET:-}" ] \
    || fail "TITAN_RECOVER_SECRET is not set: every node needs the run's secret, e.g. \$(openssl rand -hex 16), the same on each"
RUN_ID=${TITAN_RECOVER_RUN_ID:-}
if [ -n "$CONTROL_STORE" ] && [ -z "$RUN_ID" ]; then
    fail "TITAN_RECOVER_RUN_ID is not set: a run on etcd (CONTROL_STORE) needs its id, the same on every node (e.g. the job's id); a relaunched node with the same id rejoins the run"
fi
JOIN_RUN=${JOIN_RUN:-}
if [ -n "$JOIN_RUN" ]; then
    [ -z "$CONTROL_STORE" ] || fail "JOIN_RUN and CONTROL_STORE are both set: on etcd a node joins with CONTROL_STORE and the run's TITAN_RECOVER_RUN_ID alone"
    [[ $JOIN_RUN == etcd://?* ]] || { [[ $JOIN_RUN == ?*:* ]] && is_count "${JOIN_RUN##*:}"; } \
        || fail "JOIN_RUN='$JOIN_RUN' is not host:port or etcd://host:port,...: set it to the running run's coordinator (its first node and port) or its etcd"
    [ -n "$RUN_ID" ] || fail "TITAN_RECOVER_RUN_ID is not set: a joining job needs the running run's id (the first job's id under Slurm)"
fi
for arg in "$@"; do
    [ -z "$JOIN_RUN" ] || break  # a joining node passes the running run's layout itself
    case $arg in
        --parallelism.data_parallel_replicate_degree* | --recover.spares* | --recover.coordinator_bind* | --recover.coordinator_port* | --recover.group_nodes* | --recover.control_store*)
            fail "${arg%%=*} is set from the node layout here: use NODES x GROUPS_PER_NODE, GROUP_NODES, SPARES, COORDINATOR_BIND, the port of COORDINATOR_ADDR and CONTROL_STORE instead" ;;
    esac
done

first=$((NODE_INDEX / GROUP_NODES * GROUPS_PER_NODE))
replicas=""
for ((r = first; r < first + GROUPS_PER_NODE; r++)); do replicas+="${replicas:+,}$r"; done
# node 0's launcher is the one without TITAN_RECOVER_COORDINATOR: it starts the coordinator (an
# inherited value, e.g. from the submitting shell, is removed), or on etcd it starts the run (or,
# relaunched while the run goes on, joins it)
if [ -n "$CONTROL_STORE" ]; then
    addr=$CONTROL_STORE
    where=(--recover.control_store "$CONTROL_STORE")
else
    where=(--recover.coordinator_bind "$COORDINATOR_BIND" --recover.coordinator_port "$port")
fi
if [ -n "$JOIN_RUN" ]; then
    coordinator=("TITAN_RECOVER_COORDINATOR=$JOIN_RUN")
    replicas=any:$GROUPS_PER_NODE
elif [ "$NODE_INDEX" -eq 0 ]; then
    coordinator=(-u TITAN_RECOVER_COORDINATOR)
else
    coordinator=("TITAN_RECOVER_COORDINATOR=$addr")
fi
env_args=("${coordinator[@]}" "CONFIG_FILE=$CONFIG_FILE" "TITAN_RECOVER_REPLICAS=$replicas"
          "TITAN_RECOVER_GROUP_NODE=$((NODE_INDEX % GROUP_NODES))")
if [ -n "$RUN_ID" ]; then env_args+=("TITAN_RECOVER_RUN_ID=$RUN_ID"); fi
# on etcd the environment needs the etcd extra's client (a no-op where the batch script's bootstrap made it already)
if [ -n "$CONTROL_STORE" ] || [[ $JOIN_RUN == etcd://* ]]; then env_args+=("EXTRAS=${EXTRAS:+$EXTRAS,}etcd"); fi
# the node's failure domain (docs/host-memory.md#failure-domains): under Slurm's topology/tree plugin
# SLURM_TOPOLOGY_ADDR is the switch path down to the node (top.leaf.node): the path to its leaf switch
if [ -z "${TITAN_RECOVER_FAILURE_DOMAIN:-}" ] && [[ ${SLURM_TOPOLOGY_ADDR:-} == ?*.?* ]]; then
    env_args+=("TITAN_RECOVER_FAILURE_DOMAIN=${SLURM_TOPOLOGY_ADDR%.*}")
fi
# each node's processes log to a file of their own (recover_events.node<i>.jsonl): a shared dump folder
# (NFS) does not make appends from several hosts atomic
if [ -n "$JOIN_RUN" ]; then  # a log of its own beside the running run's node<i> files; the run's layout in "$@"
    env_args+=("TITAN_RECOVER_NODE=joined-${SLURM_JOB_ID:-$$}-node$NODE_INDEX")
    cmd=(./run_train.sh --recover.group_nodes "$GROUP_NODES")
    if [[ $JOIN_RUN == etcd://* ]]; then cmd+=(--recover.control_store "$JOIN_RUN"); fi
    cmd+=("$@")
else
    if [ "$NUM_NODES" -gt 1 ]; then env_args+=("TITAN_RECOVER_NODE=node$NODE_INDEX"); fi
    cmd=(./run_train.sh --parallelism.data_parallel_replicate_degree "$replicate" --recover.spares "$SPARES"
         --recover.group_nodes "$GROUP_NODES" "${where[@]}" "$@")
fi

# the secret comes from this process's environment (not the command line, which `ps` shows)
shown=$([ -n "${SHOW_SECRET:-}" ] && quote "$TITAN_RECOVER_SECRET" || echo "'<hidden>'")
echo "node $NODE_INDEX ($NODE_NAME${NODE_GPUS:+, $NODE_GPUS}): TITAN_RECOVER_SECRET=$shown $(quote env "${env_args[@]}" "${cmd[@]}")"
if [ -n "${PLAN_ONLY:-}" ]; then exit 0; fi
# Under Slurm, scripts/slurm/node_slurm.sh runs the command and does what Slurm leaves undone when the batch
# host is lost (a requeue on the TCPStore, the job's end on etcd); elsewhere this shell becomes the launcher.
if [ -n "${SLURM_JOB_ID:-}" ]; then source ./scripts/slurm/node_slurm.sh; fi
exec env "${env_args[@]}" "${cmd[@]}"
