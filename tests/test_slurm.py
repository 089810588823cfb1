"""``scripts/slurm/train.sbatch`` under a real Slurm (Debian's 22.05, ``titan_recover.tools.slurm_local``):
two Slurm nodes, each a network namespace with its own host name and address, one replica group per
node, submitted with ``sbatch`` as a user does. Each run is held against the failure-free trajectory
(every step once, M microbatches, the same data and losses). One cluster serves the whole file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SINGLES, Run, assert_same_trajectory

from titan_recover.titan.jobs import job
from titan_recover.tools import slurm_local
from titan_recover.tools.partitions import events

ROOT = Path(__file__).resolve().parents[1]
REASON = slurm_local.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no Slurm cluster here: {REASON}")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY")
RUN_S = 240.0  # a job's bound, start to end


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_local.SlurmCluster]:
    with slurm_local.SlurmCluster(2, tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def submit(slurm: slurm_local.SlurmCluster, dump: Path, plan: str, *sbatch: str) -> str:
    """The tests' job (``SINGLES``, fault plan ``plan``) submitted on both nodes; its job id."""
    config, path, *args = job(dump, tiny=True)
    assert config == "--job.config_file"
    return slurm.sbatch(
        [
            "--nodes=2",
            f"--output={dump}.out",
            *sbatch,
            "scripts/slurm/train.sbatch",
            path,
            *args,
            *SINGLES,
            "--recover.fault_plan",
            plan,
        ],
        cwd=ROOT,
    )


def finished(slurm: slurm_local.SlurmCluster, job_id: str, dump: Path) -> tuple[dict[str, str], Run]:
    """The job's end (its Slurm fields) and the run as node 0's launcher logged it."""
    fields = slurm.wait_job(job_id, ENDED, RUN_S)
    output = Path(f"{dump}.out").read_text()
    return fields, Run(0 if "0: titan_recover summary" in output else 1, output, events(dump))


def test_the_main_job_finishes_under_sbatch_on_two_slurm_nodes(
    tmp_path: Path, slurm: slurm_local.SlurmCluster, two_singles: Run
) -> None:
    """``sbatch --nodes=2 scripts/slurm/train.sbatch``: node 0's launcher starts the coordinator, node 1's
    dials it by its Slurm node name; the job completes with exit 0 on the failure-free trajectory."""
    dump = tmp_path / "dump"
    fields, run = finished(slurm, submit(slurm, dump, "none"), dump)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "0"), run.output[-3000:]
    assert_same_trajectory(two_singles, run, 1e-3, num_microbatches=4)
    assert {e["members"] == [0, 1] for e in run.steps().values()} == {True}


def test_a_failed_node_costs_only_its_group_and_slurm_leaves_the_survivor_running(
    tmp_path: Path, slurm: slurm_local.SlurmCluster, two_singles: Run
) -> None:
    """Node 1 fails in step 3 (every process of it SIGKILLed, slurmd too) while its replica stalls in a
    forward pass. Slurm marks the node down; with the script's ``--no-kill`` it neither signals node 0's
    task nor requeues the job: replica 0 takes over the step's microbatches and finishes every step with
    M of them on the failure-free data, and the job ends without a restart."""
    dump = tmp_path / "dump"
    job_id = submit(slurm, dump, "sleep replica=1 step=3 phase=forward seconds=60")
    slurm.wait(lambda: any(e["event"] == "fault_injected" for e in events(dump)), RUN_S, "replica 1's stall")
    slurm.fail(1)
    try:
        fields, run = finished(slurm, job_id, dump)
        print(fields["JobState"], fields["ExitCode"], slurm.states())
        assert "0: titan_recover summary" in run.output, run.output[-3000:]
        assert_same_trajectory(two_singles, run, 1e-3, num_microbatches=4)
        [failure] = run.of("failure")
        assert failure["replica"] == 1, failure
        assert fields["Restarts"] == "0"
        assert "SIGTERM" not in run.output.split("0: titan_recover summary")[0], run.output[-3000:]
        assert slurm.states()["node1"].startswith("down"), slurm.states()
    finally:
        slurm.start_node(1)
        slurm.wait(lambda: slurm.states().get("node1") == "idle", 60, "node1 idle again")
