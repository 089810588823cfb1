"""Replacement requests under Slurm: the one place the coordinator runs ``sbatch``, ``squeue`` and ``scancel``.

``scripts/slurm/train.sbatch`` hands the coordinator, through its environment, what a request needs: the
batch script and the arguments that make a job join this run (the config, the run's layout), the job's own
sbatch options (partition, account, GPUs, where the output goes) and the folder to submit from; the run's id,
the file its secret is saved in (never the secret) and the coordinator's address (on etcd, the run's control
store) come with them. A request is
``env JOIN_RUN=... TITAN_RECOVER_RUN_ID=... TITAN_RECOVER_SECRET_FILE=... GROUPS_PER_NODE=...
TITAN_RECOVER_REPLACEMENT=<request> sbatch --parsable --nodes=1 [--exclude=...] --export=ALL <options> <script>
<arguments>``, from an environment without the secret or this job's own Slurm variables. Every command has a
timeout, and each runs in the coordinator's worker thread, never in its pass.
"""

import os
import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from titan_recover import config
from titan_recover.control import keys
from titan_recover.control.addresses import is_etcd

SCRIPT_ENV = "TITAN_RECOVER_REPLACE_SCRIPT"  # the batch script a replacement job runs
ARGS_ENV = "TITAN_RECOVER_REPLACE_ARGS"  # its arguments, shell words: the config, overrides, the run's layout
OPTIONS_ENV = "TITAN_RECOVER_REPLACE_OPTIONS"  # the run's job's sbatch options, shell words
DIR_ENV = "TITAN_RECOVER_REPLACE_DIR"  # the checkout to submit from (the job's SLURM_SUBMIT_DIR)
JOIN_ENV = "TITAN_RECOVER_REPLACE_JOIN"  # host:port of this coordinator, as other nodes reach it (TCPStore only)
GROUPS_ENV = "GROUPS_PER_NODE"  # replica groups per node: the free ids a replacement node asks for
SUBMIT_S = 30.0  # sbatch's bound: slurmctld answers within its MessageTimeout (10 s by default)
QUERY_S = 10.0  # squeue's, scontrol's and scancel's
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SIGNALING")
"""The states of a job that has not ended (squeue -j lists ended ones too, for a while)."""
KEPT = ("SLURM_CONF",)  # the one Slurm variable of this job a submission keeps: which cluster


class SubmitError(Exception):
    """The scheduler did not take a request (no sbatch here, a site that forbids submitting from compute nodes)."""


@dataclass(frozen=True)
class Submitter:
    """What a replacement request runs, as the batch script handed it over."""

    script: str
    args: tuple[str, ...]
    options: tuple[str, ...]
    folder: str
    join: str  # what a replacement job joins (JOIN_RUN): the coordinator's host:port, or the run's etcd:// store
    run_id: str
    secret_file: str
    groups: int
    job: str  # the run's own job, whose nodes a replacement avoids

    @classmethod
    def of(cls, rc: config.Recover, env: Mapping[str, str]) -> "tuple[Submitter | None, str]":
        """The submitter for ``[recover] replace`` in this environment, or None and why not ("" where it is off)."""
        if rc.replace == "off":
            return None, ""
        needed = (SCRIPT_ENV, DIR_ENV, keys.RUN_ENV, keys.SECRET_FILE_ENV, *(() if rc.control_store else (JOIN_ENV,)))
        missing = [k for k in needed if not env.get(k)]
        if rc.group_nodes > 1 or missing or "SLURM_JOB_ID" not in env:
            return None, (
                "no replacement is asked for: only a run started by scripts/slurm/train.sbatch, one node per replica "
                "group, hands its coordinator the command to submit one"
                + (f" (unset here: {', '.join(missing)})" if missing else "")
            )
        groups = env.get(GROUPS_ENV, "1")
        if not groups.isdigit() or int(groups) < 1:
            return None, f"no replacement is asked for: {GROUPS_ENV}={groups!r} is not a count of groups"
        return cls(
            script=env[SCRIPT_ENV],
            args=tuple(shlex.split(env.get(ARGS_ENV, ""))),
            options=tuple(shlex.split(env.get(OPTIONS_ENV, ""))),
            folder=env[DIR_ENV],
            join=rc.control_store or env[JOIN_ENV],  # on etcd the run's members, as the launchers rewrote nodes://
            run_id=env[keys.RUN_ENV],
            secret_file=env[keys.SECRET_FILE_ENV],
            groups=int(groups),
            job=env["SLURM_JOB_ID"],
        ), ""

    def command(self, request: int, exclude: Sequence[str]) -> list[str]:
        """The sbatch command of request ``request``, avoiding the nodes ``exclude``. Its variables go through
        ``env`` and ``--export=ALL``: sbatch's ``--export=NAME=VALUE,...`` splits a value at its commas, and an
        ``etcd://`` store has them."""
        export = {
            "JOIN_RUN": self._joining(),
            keys.RUN_ENV: self.run_id,
            keys.SECRET_FILE_ENV: self.secret_file,
            GROUPS_ENV: str(self.groups),
            keys.REPLACEMENT_ENV: str(request),
        }
        return [
            "env",
            *(f"{k}={v}" for k, v in export.items()),
            "sbatch",
            "--parsable",
            "--nodes=1",
            *([f"--exclude={','.join(exclude)}"] if exclude else []),
            "--export=ALL",
            *self.options,
            self.script,
            *self.args,
        ]

    def _joining(self) -> str:
        """``join`` now: on etcd, the members this process last read (a lost member may have been replaced)."""
        if not is_etcd(self.join):
            return self.join
        from titan_recover.control.etcd_store import followed  # the etcd client: a run on etcd has it

        return followed(self.join)

    def shown(self, argv: Sequence[str]) -> str:
        """``argv`` as a person runs it from a login node's shell."""
        return f"cd {shlex.quote(self.folder)} && {shlex.join(argv)}"

    def submit(self, argv: Sequence[str]) -> str:
        """Submits ``argv`` (``command``); the job's id, or ``SubmitError`` saying why not."""
        done = _run(argv, SUBMIT_S, self.folder)
        job = done.stdout.strip().split(";")[0]
        if done.returncode != 0 or not job.isdigit():
            said = (done.stderr or done.stdout).strip().splitlines()
            raise SubmitError(f"sbatch exited {done.returncode}: {said[-1] if said else 'no output'}")
        return job

    def in_the_run(self, hosts: Sequence[str]) -> list[str]:
        """Those of ``hosts`` (launchers' host names) that are nodes of the run's own job: Slurm took nothing wrong
        with them (it removes a failed node from the job), so a replacement avoids them. A node it removed and
        returned to service since was repaired, and may take the replacement."""
        names = sorted({h.split(".")[0] for h in hosts})
        if not names:
            return []
        listed = _run(["squeue", "-h", "-j", self.job, "-o", "%N"], QUERY_S, self.folder)
        nodes = listed.stdout.strip()
        if listed.returncode != 0 or not nodes:
            return []  # the job's nodes unknown: Slurm keeps its own down nodes out of any job anyway
        expanded = _run(["scontrol", "show", "hostnames", nodes], QUERY_S, self.folder)
        return [n for n in names if n in expanded.stdout.split()]

    def states(self, jobs: Sequence[str]) -> dict[str, str]:
        """Each of ``jobs`` squeue lists -> its state (``PENDING``, ``RUNNING``, ``COMPLETED``, ...); a job it does
        not list ended long ago. ``SubmitError`` where squeue did not answer: nothing can be told then."""
        listed = _run(["squeue", "-h", "-j", ",".join(jobs), "-o", "%i %T"], QUERY_S, self.folder)
        if listed.returncode != 0 and "Invalid job id" not in listed.stderr:
            raise SubmitError(f"squeue exited {listed.returncode}: {listed.stderr.strip()}")
        return dict(line.split(None, 1) for line in listed.stdout.splitlines() if len(line.split()) == 2)

    def cancel(self, job: str) -> str:
        """Cancels ``job``: "" when Slurm took it, else why not."""
        try:
            done = _run(["scancel", job], QUERY_S, self.folder)
        except SubmitError as e:
            return str(e)
        return "" if done.returncode == 0 else f"scancel {job} exited {done.returncode}: {done.stderr.strip()}"


def environment(env: Mapping[str, str]) -> dict[str, str]:
    """A submission's environment: this one without the run's secret, this node's titan_recover variables, the
    run's control store (the new job joins by ``JOIN_RUN``) and this job's Slurm variables (the new job gets its
    own), which ``--export=ALL`` would hand over."""
    return {
        k: v
        for k, v in env.items()
        if k in KEPT
        or not (k.startswith(("SLURM_", "TITAN_RECOVER_")) or k in ("NODE_INDEX", "NODE_NAME", "CONTROL_STORE"))
    }


def _run(argv: Sequence[str], timeout_s: float, cwd: str) -> "subprocess.CompletedProcess[str]":
    """``argv`` run to its end within ``timeout_s``, or ``SubmitError`` saying why it did not run."""
    try:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=cwd,
            env=environment(os.environ),
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise SubmitError(f"no {argv[0]} on PATH here") from None
    except subprocess.TimeoutExpired:
        raise SubmitError(f"{argv[0]} gave no answer within {timeout_s:g}s") from None
    except OSError as e:
        raise SubmitError(f"{argv[0]} could not run: {e}") from None


@dataclass(frozen=True)
class Submitted:
    request: int
    job: str
    command: str  # as a person would run it


@dataclass(frozen=True)
class Refused:
    request: int
    error: str
    command: str


@dataclass(frozen=True)
class Listed:
    states: dict[int, str]  # request -> its job's state; a request whose job squeue no longer lists: "gone"


@dataclass(frozen=True)
class NotCancelled:
    job: str
    error: str


Result = Submitted | Refused | Listed | NotCancelled


class Scheduler:
    """The submitter's commands in one worker thread, their results collected by the coordinator's pass
    (``results``): a slow slurmctld never holds up failure detection."""

    def __init__(self, submitter: Submitter) -> None:
        self.submitter = submitter
        self.pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="titan-recover-slurm")
        self.running: list[Future[Result | None]] = []
        self.listing = False  # a squeue of the open requests' jobs is under way

    def request(self, number: int, hosts: Sequence[str]) -> None:
        """Submits request ``number``, avoiding those of ``hosts`` (the lost groups' last hosts) still in the run."""
        self._do(lambda: self._request(number, hosts))

    def _request(self, number: int, hosts: Sequence[str]) -> Result:
        try:
            exclude = self.submitter.in_the_run(hosts)
        except SubmitError:
            exclude = []  # sbatch says what is wrong with the scheduler, next
        argv = self.submitter.command(number, exclude)
        shown = self.submitter.shown(argv)
        try:
            return Submitted(number, self.submitter.submit(argv), shown)
        except SubmitError as e:
            return Refused(number, str(e), shown)

    def ask_states(self, jobs: Mapping[int, str]) -> None:
        """Asks for the state of each request's job (``Listed``), unless such a question is under way."""
        if self.listing or not jobs:
            return
        self.listing = True
        self._do(lambda: self._list(dict(jobs)))

    def _list(self, jobs: dict[int, str]) -> Result:
        try:
            states = self.submitter.states(list(jobs.values()))
        except SubmitError:
            return Listed({})  # nothing told: asked again later
        return Listed({number: states.get(job, "gone") for number, job in jobs.items()})

    def cancel(self, job: str) -> None:
        self._do(lambda: self._cancel(job))

    def _cancel(self, job: str) -> Result | None:
        error = self.submitter.cancel(job)
        return NotCancelled(job, error) if error else None

    def _do(self, work: Callable[[], Result | None]) -> None:
        if self.pool is None:  # closed: the run's end, where each command runs in turn
            done: Future[Result | None] = Future()
            done.set_result(work())
            self.running.append(done)
        else:
            self.running.append(self.pool.submit(work))

    def results(self) -> list[Result]:
        """The results of the commands that ended since the last call."""
        done = [f.done() for f in self.running]
        found = [r for f, d in zip(self.running, done) if d and (r := f.result()) is not None]
        self.running = [f for f, d in zip(self.running, done) if not d]
        if any(isinstance(r, Listed) for r in found):
            self.listing = False
        return found

    def close(self) -> list[Result]:
        """Waits for the commands under way (each within its timeout); later commands run at once, in turn."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        return self.results()
