"""A real Slurm cluster on this machine, for the tests of ``scripts/slurm/train.sbatch``: Debian's
``slurmctld`` and one ``slurmd`` per node, each node a network namespace of ``netns`` (its own
address), with its own host name (a UTS namespace) and a private hosts file naming every node
(bind-mounted in the daemon's mount namespace: the machine's ``/etc/hosts`` is left alone); the
controller in a namespace of its own; authentication by a ``munged`` of the cluster's own (its key and
socket in the cluster's folder). Every task a job starts runs in its node's namespaces, as on a cluster.

Faults: a node failed (every process of it SIGKILLed, ``slurmd`` included) or cut off (its cable
pulled), and brought back (``slurmd`` started again: ``ReturnToService=2`` makes it idle once it
registers). The cluster removes everything it made on exit, also when the test fails: daemons, tasks,
namespaces (the mounts live in the daemons' mount namespaces and go with them).

Preemption (``grace_s``): ``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE``, the default partition
``main`` with that ``GraceTime`` under ``urgent`` (``URGENT``), a partition of a higher ``PriorityTier`` over the
same nodes: a job submitted there preempts main's, which Slurm SIGTERMs and, once the grace is over, requeues.
Jobs within ``main`` never preempt each other.

Needs root, ``nsenter`` and ``unshare`` (util-linux), netns's ``ip`` and ``nft``, and Debian's
``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge``; ``unavailable()`` says why not where they
are missing. Client commands (``sbatch``, ``scontrol``, ...) run inside the controller's namespace.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from titan_recover.tools.clusters import netns

log = logging.getLogger(__name__)

CONTROLLER = "slurmctl"  # the controller's host name
NODE_PREFIX = "node"  # the nodes' host names: node0, node1, ...
COMMAND_TIMEOUT_S = 20.0
READY_S = 60.0  # how long the daemons get to start and every node to register idle
PROGRAMS = {
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
    "scontrol": "slurm-client",
    "munged": "munge",
    "nsenter": "util-linux",
    "unshare": "util-linux",
}
CONF = """\
ClusterName=titanrecover
SlurmctldHost={controller}({controller_address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge.sock
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
StateSaveLocation={folder}/ctld
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.%n.log
JobCompType=jobcomp/filetxt
JobCompLoc={folder}/jobcomp.txt
ReturnToService=2
SlurmdTimeout=2
MessageTimeout=5
InactiveLimit=0
KillWait={kill_wait}
MinJobAge=300
{preemption}
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP{main}
"""
URGENT = "urgent"  # the partition whose jobs preempt main's, where preemption is on
PREEMPTION = """\
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
PartitionName={urgent} Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF"""


def unavailable() -> str | None:
    """Why this machine cannot run the cluster, or None when it can."""
    why = netns.unavailable()
    if why:
        return why
    for program, package in PROGRAMS.items():
        if shutil.which(program) is None:
            return f"`{program}` is not installed (Debian package {package}; ./run_tests.sh installs it as root)"
    return None


class SlurmCluster:
    """``size`` Slurm nodes (``node0`` ...) and a controller, state and logs under ``folder``:
    ``with SlurmCluster(2, tmp) as s: job = s.sbatch([...])``."""

    def __init__(self, size: int, folder: Path, kill_wait_s: int = 30, grace_s: int = 0) -> None:
        self.net = netns.Cluster(size + 1)  # namespace 0: the controller
        self.controller, *self.nodes = self.net.nodes
        self.names = [f"{NODE_PREFIX}{i}" for i in range(size)]
        self.folder = folder
        self.kill_wait_s = kill_wait_s
        self.grace_s = grace_s
        self.conf = folder / "slurm.conf"
        self.hosts = folder / "hosts"
        self.munged: subprocess.Popen | None = None

    def __enter__(self) -> SlurmCluster:
        self.net.__enter__()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Every daemon and task gone with the namespaces; the cluster's own munged stopped."""
        self.net.close()
        if self.munged is not None and self.munged.poll() is None:
            self.munged.kill()
            self.munged.wait(timeout=COMMAND_TIMEOUT_S)

    def _start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o755)  # munged checks the socket's folder
        for sub in ("ctld", "spool"):
            (self.folder / sub).mkdir(exist_ok=True)
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        self.hosts.write_text(
            "127.0.0.1 localhost\n"
            + f"{self.controller.address} {CONTROLLER}\n"
            + "".join(f"{n.address} {name}\n" for n, name in zip(self.nodes, self.names))
        )
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={n.address} CPUs=1 State=UNKNOWN" for n, name in zip(self.nodes, self.names)
        )
        self.conf.write_text(
            CONF.format(
                controller=CONTROLLER,
                controller_address=self.controller.address,
                folder=self.folder,
                kill_wait=self.kill_wait_s,
                nodes=nodes,
                preemption=PREEMPTION.format(urgent=URGENT) if self.grace_s else "",
                main=f" PriorityTier=1 GraceTime={self.grace_s}" if self.grace_s else "",
            )
        )
        self.munged = subprocess.Popen(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.folder}/munge.sock",
                f"--key-file={key}",
                f"--log-file={self.folder}/munged.log",
                f"--pid-file={self.folder}/munged.pid",
                f"--seed-file={self.folder}/munged.seed",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.wait(lambda: (self.folder / "munge.sock").exists(), READY_S, "munged's socket")
        self._daemon(self.controller, CONTROLLER, ["slurmctld", "-D", "-f", str(self.conf)])
        self.wait(lambda: self.client(["scontrol", "ping"], check=False).returncode == 0, READY_S, "slurmctld")
        for index in range(len(self.nodes)):
            self.start_node(index)
        self.wait(lambda: self.states() == dict.fromkeys(self.names, "idle"), READY_S, "every node idle")
        log.info(f"Slurm cluster of {len(self.nodes)} node(s) up, state in {self.folder}")

    def wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Waits until ``done()``; TimeoutError naming ``what``, with the end of slurmctld's log."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                logged = self.folder / "slurmctld.log"
                tail = logged.read_text()[-2000:] if logged.exists() else ""
                raise TimeoutError(f"{what}: not within {timeout_s:g}s (the cluster's state: {self.folder})\n{tail}")
            time.sleep(0.1)

    def _daemon(self, node: netns.Node, hostname: str, argv: Sequence[str]) -> subprocess.Popen:
        """``argv`` in ``node``'s network namespace, with a UTS and a mount namespace of its own: its host
        name, and the cluster's hosts file over ``/etc/hosts``. ``nsenter``, not ``ip netns exec``: that
        remounts ``/sys``, hiding the cgroup tree slurmd reads."""
        script = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
        proc = subprocess.Popen(
            [
                *self.net.entering(node),
                "nsenter",
                f"--net=/run/netns/{node.ns}",
                "unshare",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                "sh",
                str(self.hosts),
                hostname,
                *argv,
            ],
            env=self.env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.net.procs.append(proc)
        return proc

    # --- the cluster as its users see it ------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment of a client command: this cluster's slurm.conf."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def client(
        self, argv: Sequence[str], check: bool = True, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (``sbatch``, ``scontrol``, ``scancel``, ...) run in the controller's namespace."""
        done = subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.controller.ns}", *argv],
            env={**self.env(), **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        if check and done.returncode != 0:
            raise netns.NetnsError(f"{' '.join(argv)} exited {done.returncode}: {(done.stderr or done.stdout).strip()}")
        return done

    def sbatch(self, argv: Sequence[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submits a batch job; its id."""
        return self.client(["sbatch", "--parsable", *argv], env=env, cwd=cwd).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``ExitCode``, ``Restarts``, ``NodeList``, ...)."""
        out = self.client(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(word.split("=", 1) for word in out.split() if "=" in word)

    def wait_job(self, job_id: str, states: Sequence[str], timeout_s: float) -> dict[str, str]:
        """Waits until job ``job_id``'s state is one of ``states``; its fields then."""
        deadline = time.monotonic() + timeout_s
        while (fields := self.job(job_id))["JobState"] not in states:
            if time.monotonic() > deadline:
                state = fields["JobState"]
                raise TimeoutError(f"job {job_id} is {state}, not {'/'.join(states)}, after {timeout_s:g}s")
            time.sleep(0.2)
        return fields

    def queued(self) -> list[str]:
        """The ids of the jobs not ended yet (pending, running, completing)."""
        return self.client(["squeue", "-h", "-o", "%i"], check=False).stdout.split()

    def states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` prints it (``idle``, ``alloc``, ``down*``, ...)."""
        out = self.client(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def down(self, index: int) -> bool:
        """Whether Slurm has marked node ``index`` down (``down``, or ``down*``: down and not responding)."""
        return self.states().get(self.names[index], "").startswith("down")

    def processes(self, index: int) -> list[str]:
        """The names of node ``index``'s processes (``slurmd``, a job's ``slurmstepd``, ``python3``, ...)."""
        names = []
        for pid in self.net.pids(self.nodes[index]):
            with contextlib.suppress(OSError):
                names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        return names

    # --- faults ----------------------------------------------------------------------------------

    def fail(self, index: int) -> list[int]:
        """Node ``index`` lost: every process of it SIGKILLed, ``slurmd`` and the job's tasks."""
        return self.net.kill(self.nodes[index])

    @contextlib.contextmanager
    def cut_off(self, index: int) -> Iterator[None]:
        """Node ``index``'s cable pulled until the block ends: its processes run on, unreachable."""
        with self.net.unplugged(self.nodes[index]):
            yield

    def start_node(self, index: int) -> None:
        """``slurmd`` of node ``index`` started (again: a repaired node)."""
        name = self.names[index]
        (self.folder / "spool" / name).mkdir(parents=True, exist_ok=True)
        self._daemon(self.nodes[index], name, ["slurmd", "-D", "-f", str(self.conf), "-N", name])
