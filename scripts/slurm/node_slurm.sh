# shellcheck shell=bash
# scripts/node.sh's part under Slurm: node.sh sources it when SLURM_JOB_ID is set, once the node's plan is made
# (env_args, cmd, NODE_INDEX, NODE_NAME, hosts, addr, CONTROL_STORE, JOIN_RUN). It runs the node's command and
# does what Slurm leaves undone when the batch host is lost (with --no-kill); it ends with the launcher's exit
# status. Kubernetes pods and plain hosts never read it: there node.sh execs the command.
#
# On the TCPStore, the node that ran the coordinator may be lost; it was the batch host, and with --no-kill
# Slurm leaves the job RUNNING with no batch script. A node whose launcher lost the coordinator (exit 3,
# EXIT_COORDINATOR_LOST) waits for Slurm's own verdict on that node (not responding or down, within its
# SlurmdTimeout) and requeues the job: it resumes from the last checkpoint. A coordinator lost from here
# only (a partition between the nodes, the node still answering Slurm) requeues nothing.
#
# Slurm's own preemption (PreemptMode=REQUEUE, a GraceTime on the run's partition) sets the job's PreemptTime and
# SIGTERMs every task: the run stops in order and saves (exit 5, or 4). Slurm requeues the job by itself, but only
# when it ends it, once the grace is over: a job whose batch script ended first is over (measured: COMPLETED, never
# requeued). So a preempted node's task outlives its launcher until Slurm ends the job, and requeues nothing itself,
# on any exit: the job is requeued once.
preempted() { scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -q ' PreemptTime=[0-9]'; }
await_requeue() {  # until Slurm ends the preempted job (and requeues it): its grace, then Slurm's periodic check (30 s)
    local grace state wait
    grace=$(scontrol show partition "${SLURM_JOB_PARTITION:-}" 2>/dev/null | sed -n 's/.*GraceTime=\([0-9]*\).*/\1/p' | head -n 1 || true)
    wait=$((${grace:-0} + 300))  # generous: a task that ends first ends the job, which Slurm then never requeues
    echo "[node.sh] job $SLURM_JOB_ID is preempted (the launcher exited $rc): Slurm requeues it when it ends it, after its GraceTime; waiting for that (at most ${wait}s)"
    local deadline=$((SECONDS + wait))
    while [ "$SECONDS" -lt "$deadline" ]; do
        state=$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>/dev/null || true)  # none: Slurm did not answer
        [ -z "$state" ] || [ "$state" = RUNNING ] || return 0
        sleep 1
    done
    echo "error: [node.sh] job $SLURM_JOB_ID still running ${wait}s after its launcher exited: this task ends, and a job that ends by itself is not requeued: requeue it by hand (scontrol requeue $SLURM_JOB_ID)" >&2
}
node_state() { sinfo -h -N -n "$1" -o %t 2>/dev/null || true; }  # as sinfo prints it: idle, alloc*, down*, ...
is_lost() { case $1 in *'*'* | down* | fail*) return 0 ;; *) return 1 ;; esac; }  # not responding, down or failed
requeue_if_lost() {  # the coordinator's Slurm node
    local node=$1 wait state
    wait=$(scontrol show config 2>/dev/null | sed -n 's/^SlurmdTimeout *= *\([0-9]*\).*/\1/p' || true)  # none: 300
    local deadline=$((SECONDS + ${wait:-300} + 30))
    while [ "$SECONDS" -lt "$deadline" ]; do
        state=$(node_state "$node")
        if is_lost "$state"; then
            echo "[node.sh] the coordinator's node $node is $state to Slurm: requeueing job $SLURM_JOB_ID, which resumes from the last checkpoint"
            scontrol requeue "$SLURM_JOB_ID" || echo "error: [node.sh] scontrol requeue $SLURM_JOB_ID failed: requeue it by hand" >&2
            return 0
        fi
        sleep 2
    done
    echo "[node.sh] the coordinator was lost from here, but Slurm still finds $node ${state:-unknown}: not requeueing (a partition between the nodes?)"
}
# On etcd the run outlives the batch host, and so does the job: Slurm removes the lost node from it (--no-kill)
# but ends it only when its batch script does, and that died with the node (measured: still RUNNING, holding
# the other nodes, 109 s after the run ended; the repaired node, idle again, did not change that). Once the run
# has ended here, the first node left in the job ends it. The batch host's loss is Slurm's verdict, as above:
# one it has not yet found (within SlurmdTimeout of the end) leaves the job to its time limit.
end_if_orphaned() {  # the batch host's Slurm node
    local batch=$1 state nodes node
    state=$(node_state "$batch")
    nodes=$(squeue -h -j "$SLURM_JOB_ID" -o %N 2>/dev/null || true)
    mapfile -t nodes < <([ -n "$nodes" ] && scontrol show hostnames "$nodes")
    [ ${#nodes[@]} -gt 0 ] || return 0  # ended already, or Slurm did not answer
    if [[ " ${nodes[*]} " == *" $batch "* ]] && ! is_lost "$state"; then return 0; fi  # its batch script ends it
    for node in "${nodes[@]}"; do
        [ "$node" = "$batch" ] && continue
        [ "$node" = "$NODE_NAME" ] || return 0  # not the first node left
        break
    done
    echo "[node.sh] the run ended here (exit $rc), and job $SLURM_JOB_ID lost its batch host $batch (${state:-gone}), whose script would have ended it: ending it (scancel) to free its nodes"
    scancel "$SLURM_JOB_ID" || echo "error: [node.sh] scancel $SLURM_JOB_ID failed: cancel it by hand" >&2
}
trap 'true' TERM  # Slurm signals every process of the step: the launcher acts on it, this shell waits for it
set +e
env "${env_args[@]}" "${cmd[@]}"
rc=$?
set -e
if [ "$rc" -ne 0 ] && preempted; then
    await_requeue
elif [ "$rc" -eq 3 ] && [ -z "$CONTROL_STORE" ] && [ -z "$JOIN_RUN" ] && [ "$NODE_INDEX" -gt 0 ]; then
    requeue_if_lost "${hosts[0]:-${addr%:*}}"
elif [ -n "$CONTROL_STORE" ] && [ "$NODE_INDEX" -gt 0 ] && [ ${#hosts[@]} -gt 0 ]; then
    end_if_orphaned "${hosts[0]}"
fi
if [ -n "${TITAN_RECOVER_EXITS_DIR:-}" ]; then  # for train.sbatch: srun's status counts nodes that left the job
    echo "$rc" > "$TITAN_RECOVER_EXITS_DIR/$NODE_NAME" || echo "[node.sh] could not write this node's status to $TITAN_RECOVER_EXITS_DIR" >&2
fi
exit "$rc"
