"""Trajectory fidelity against torchft: one SIGKILL, under torchft and under titan_recover.

The same job (llama3 via the ``llama3_recover`` train spec, the same seed, data, batch, lr
and steps; R = 2 replica groups of ``shards`` FSDP ranks; no restart of the killed group)
runs four times: failure-free and with ``kill replica=1 rank=0 step=K phase=backward``,
under TorchTitan's fault-tolerance trainer with torchft (``bench/torchft_train.py``: a
torchft Lighthouse plus one torchrun per replica group, torchft's gloo process group) and
under titan_recover (``titan_recover.launch``, ``--recover.max_restarts 0``). The SIGKILL
lands at the same point in both (titan_recover's ``FaultInjector``: inside the middle
transformer block's backward, during the group's second microbatch).

Per system, against its own failure-free run:

- per-step relative loss deviation ``|loss_kill - loss_ff| / |loss_ff|`` over the steps the
  kill run committed, and its max; for torchft also against the failure-free loss of the
  same samples (the surviving groups' part of the failure-free batch), which separates the
  drift of the weights from the smaller batch;
- samples skipped (a failure-free sample that no committed step used) and repeated (used
  by more than one committed step, or twice in one); a sample is a global sample index of
  titan_recover's addressable data (``addressing.sample_indices``), and the token digests of
  every step are checked against the failure-free run's;
- global batch (samples) per step, 0 for a step that did not commit;
- recovery latency, defined the same for both: wall time from the SIGKILL (the
  ``fault_injected`` event written just before the signal) to the end of the survivors'
  first step that commits after it; that step's own compute is inside, so the median
  failure-free step time is reported beside it.

    .venv/bin/python -m bench.fidelity [--quick] [--shards 1|2]

Needs torchft (a benchmark extra): ``.venv/bin/pip install torchft==0.2.0`` (it keeps the
installed torch). Writes bench/results/fidelity.json and prints a short table.
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import CONFIG, PRECISION, ROOT, write_result
from titan_recover.control.transport import free_port
from titan_recover.data import addressing
from titan_recover.launch.torchruns import with_threads
from titan_recover.observability.events import events_path, of_kind, read_events

BIN = Path(sys.executable).parent
RUN_TIMEOUT_S = 900
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class Setup:
    """What both systems run."""

    steps: int
    fault_step: int
    shards: int = 1
    replicas: int = 2
    flavor: str = "tiny"
    seq_len: int = 64
    local_batch: int = 2
    global_batch: int = 16
    warmup_steps: int = 2
    seed: int = 42
    killed_replica: int = 1
    heartbeat_timeout_s: float = 5.0  # titan_recover's [recover] default; the Lighthouse's default too

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.local_batch * self.shards)

    @property
    def fault_plan(self) -> str:
        return f"kill replica={self.killed_replica} rank=0 step={self.fault_step} phase=backward"

    def overrides(self) -> list[str]:
        """TorchTitan CLI overrides shared by both systems (the rest comes from CONFIG)."""
        return [
            "--model.flavor",
            self.flavor,
            "--training.seq_len",
            str(self.seq_len),
            "--training.steps",
            str(self.steps),
            "--training.local_batch_size",
            str(self.local_batch),
            "--training.global_batch_size",
            str(self.global_batch),
            "--lr_scheduler.warmup_steps",
            str(self.warmup_steps),
            "--debug.seed",
            str(self.seed),
            *PRECISION,
            "--metrics.log_freq",
            "1",
            "--parallelism.data_parallel_shard_degree",
            str(self.shards),
        ]

    def samples(self, step: int, microbatch: int, shard: int) -> range:
        return addressing.sample_indices(
            step,
            microbatch,
            shard,
            num_microbatches=self.num_microbatches,
            shards=self.shards,
            local_batch=self.local_batch,
        )


@dataclass
class Step:
    """One committed step as a system reports it."""

    loss: float
    time: float
    samples: list[int]
    replicas: list[int]  # replica groups whose gradients went into the step
    data: list[str]  # token digests, compared with the failure-free run's
    by_replica: dict[int, tuple[float, list[str]]]  # torchft only: each group's (loss, digests)


@dataclass
class Run:
    commands: list[str]  # shell lines, in the order they were started
    wall_s: float
    steps: dict[int, Step]
    fault_time: float | None
    extra: dict[str, Any]


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Starts ``cmd`` in its own session, so that ``_stop`` also reaches torchrun's workers."""
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGKILLs what is left of a process started by ``_start`` and its children."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _failed(what: str, log: Path, code: int | None) -> RuntimeError:
    return RuntimeError(f"{what} exited with {code}; end of {log}:\n{log.read_text()[-4000:]}")


def _fault_time(events: list[dict[str, Any]]) -> float | None:
    faults = of_kind(events, "fault_injected")
    return faults[0]["time"] if faults else None


# ---- titan_recover --------------------------------------------------------------------


def run_recover(setup: Setup, plan: str, dump: Path) -> Run:
    cmd = [
        sys.executable,
        "-m",
        "titan_recover.launch",
        "--job.config_file",
        str(CONFIG),
        "--job.dump_folder",
        str(dump),
        *setup.overrides(),
        "--parallelism.data_parallel_replicate_degree",
        str(setup.replicas),
        "--recover.max_restarts",
        "0",
        "--recover.heartbeat_timeout_s",
        str(setup.heartbeat_timeout_s),
        "--recover.fault_plan",
        plan,
    ]
    dump.mkdir(parents=True)
    log = dump / "launch.log"
    start = time.monotonic()
    proc = _start(cmd, log, ENV)
    try:
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        _stop(proc)
    if code != 0:
        raise _failed("titan_recover", log, code)
    wall = time.monotonic() - start
    events = list(read_events(events_path(str(dump))))
    steps = {
        e["step"]: Step(
            loss=e["loss"],
            time=e["time"],
            replicas=e["members"],
            data=[e["data_digest"]],
            by_replica={},
            samples=[s for m in e["microbatches"] for k in range(setup.shards) for s in setup.samples(e["step"], m, k)],
        )
        for e in of_kind(events, "step")
    }
    extra = {
        "recovered_latency_s": [e["latency_s"] for e in of_kind(events, "recovered")],
        "failures": [e["cause"] for e in of_kind(events, "failure")],
    }
    return Run([shlex.join(cmd)], wall, steps, _fault_time(events), extra)


# ---- torchft --------------------------------------------------------------------------


def _wait_listening(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise _failed("torchft_lighthouse", log, proc.returncode)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"torchft_lighthouse not listening on port {port} after {timeout_s}s")


def torchft_steps(setup: Setup, events: list[dict[str, Any]]) -> dict[int, Step]:
    """Committed steps from the per-rank ``ft_step`` events. A group's loss is the sum of its
    ranks' (each is divided by the group's tokens already); the step's is the mean over groups."""
    by_step: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in of_kind(events, "ft_step"):
        if e["committed"]:
            by_step[e["step"]].append(e)
    steps = {}
    for step, ranks in by_step.items():
        ranks.sort(key=lambda e: (e["replica"], e["rank"]))
        groups: dict[int, tuple[float, list[str]]] = {}
        for e in ranks:
            loss, digests = groups.get(e["replica"], (0.0, []))
            groups[e["replica"]] = (loss + e["loss"], digests + e["digests"])
        steps[step] = Step(
            loss=statistics.fmean(loss for loss, _ in groups.values()),
            time=max(e["time"] for e in ranks),
            samples=[s for e in ranks for m in e["microbatches"] for s in setup.samples(step, m, e["shard"])],
            replicas=sorted(groups),
            data=[d for _, ds in groups.values() for d in ds],
            by_replica=groups,
        )
    return steps


def lighthouse(setup: Setup, dump: Path) -> tuple[subprocess.Popen, list[str], int]:
    """A torchft Lighthouse for ``dump``'s groups, listening: its process, command and port."""
    port = free_port()
    cmd = [
        str(BIN / "torchft_lighthouse"),
        "--min_replicas",
        "1",
        "--bind",
        f"[::]:{port}",
        "--heartbeat_timeout_ms",
        str(int(setup.heartbeat_timeout_s * 1000)),
    ]
    log = dump / "lighthouse.log"
    proc = _start(cmd, log, ENV)
    try:
        _wait_listening(port, proc, log)
    except RuntimeError:
        _stop(proc)
        raise
    return proc, cmd, port


def torchft_group(setup: Setup, replica: int, plan: str, dump: Path) -> list[str]:
    """One replica group's torchrun under TorchTitan's fault-tolerance trainer, ``setup.replicas`` in all."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        f"--nproc_per_node={setup.shards}",
        "--max_restarts",
        "0",
        "--role",
        f"replica{replica}",
        "bench/torchft_train.py",
        "--job.config_file",
        str(CONFIG),
        "--job.dump_folder",
        str(dump),
        *setup.overrides(),
        "--model.name",
        "llama3_recover_torchft",
        "--parallelism.data_parallel_replicate_degree",
        "1",
        "--fault_tolerance.enable",
        "--fault_tolerance.replica_id",
        str(replica),
        "--fault_tolerance.group_size",
        str(setup.replicas),
        "--fault_tolerance.process_group",
        "gloo",
        "--recover.fault_plan",
        plan,
    ]


def torchft_env(setup: Setup, port: int) -> dict[str, str]:
    """The groups' environment: the Lighthouse, and the thread split titan_recover's launcher makes, so that
    neither oversubscribes the cores."""
    return with_threads({**ENV, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}, setup.replicas * setup.shards)


def run_torchft(setup: Setup, plan: str, dump: Path) -> Run:
    dump.mkdir(parents=True)
    light, lighthouse_cmd, port = lighthouse(setup, dump)
    groups: dict[int, subprocess.Popen] = {}
    cmds: dict[int, list[str]] = {}
    try:
        env = torchft_env(setup, port)
        start = time.monotonic()
        for r in range(setup.replicas):
            cmds[r] = torchft_group(setup, r, plan, dump)
            groups[r] = _start(cmds[r], dump / f"replica{r}.log", env)
        for r, proc in groups.items():
            if proc.wait(timeout=RUN_TIMEOUT_S) != 0 and not (plan != "none" and r == setup.killed_replica):
                raise _failed(f"torchft replica group {r}", dump / f"replica{r}.log", proc.returncode)
        wall = time.monotonic() - start
    finally:
        for proc in [*groups.values(), light]:
            _stop(proc)
    events = list(read_events(events_path(str(dump))))
    extra = {
        "env": {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"},
        "participants": {
            e["step"]: e["participants"] for e in of_kind(events, "ft_step") if e["replica"] == e["rank"] == 0
        },
        "uncommitted_steps": sorted({e["step"] for e in of_kind(events, "ft_step") if not e["committed"]}),
    }
    commands = [shlex.join(c) for c in (lighthouse_cmd, *cmds.values())]
    return Run(commands, wall, torchft_steps(setup, events), _fault_time(events), extra)


# ---- analysis -------------------------------------------------------------------------


def _median_step_time(run: Run) -> float:
    times = [run.steps[s].time for s in sorted(run.steps)]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def _step_row(step: int, ref: Step, got: Step | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "step": step,
        "loss_ff": ref.loss,
        "loss": None,
        "rel_dev": None,
        "samples": 0,
        "replicas": [],
        "data_matches_ff": None,
    }
    if got is None:
        return row
    row.update(
        loss=got.loss, rel_dev=abs(got.loss - ref.loss) / abs(ref.loss), samples=len(got.samples), replicas=got.replicas
    )
    if ref.by_replica:  # torchft: also against the failure-free loss of the same groups' samples
        same = statistics.fmean(ref.by_replica[r][0] for r in got.replicas)
        row["rel_dev_same_samples"] = abs(got.loss - same) / abs(same)
        row["data_matches_ff"] = all(got.by_replica[r][1] == ref.by_replica[r][1] for r in got.replicas)
    else:
        row["data_matches_ff"] = got.data == ref.data
    return row


def analyze(setup: Setup, ff: Run, kill: Run) -> dict[str, Any]:
    """Fidelity of ``kill`` against ``ff``, the same system's failure-free run."""
    if sorted(ff.steps) != list(range(1, setup.steps + 1)):
        raise RuntimeError(f"the failure-free run committed steps {sorted(ff.steps)}, not 1..{setup.steps}")
    per_step = [_step_row(s, ff.steps[s], kill.steps.get(s)) for s in range(1, setup.steps + 1)]
    expected = collections.Counter(s for st in ff.steps.values() for s in st.samples)
    if any(c != 1 for c in expected.values()):
        raise RuntimeError("the failure-free run used a sample twice")
    used = collections.Counter(s for st in kill.steps.values() for s in st.samples)
    fault = kill.fault_time
    after = sorted(st.time for st in kill.steps.values() if fault is not None and st.time > fault)
    return {
        "max_rel_loss_dev": max(r["rel_dev"] for r in per_step if r["rel_dev"] is not None),
        "steps_committed": len(kill.steps),
        "samples_ff": sum(expected.values()),
        "samples_used": sum(used.values()),
        "samples_skipped": sum(1 for s in expected if s not in used),
        "samples_repeated": sum(c - 1 for c in used.values() if c > 1),
        "samples_not_in_ff": sum(c for s, c in used.items() if s not in expected),
        "data_mismatch_steps": [r["step"] for r in per_step if r["data_matches_ff"] is False],
        "global_batch_per_step": [r["samples"] for r in per_step],
        "recovery_s": after[0] - fault if after and fault is not None else None,
        "median_ff_step_s": _median_step_time(ff),
        "per_step": per_step,
        "wall_s": {"ff": round(ff.wall_s, 1), "kill": round(kill.wall_s, 1)},
        "commands": {"ff": ff.commands, "kill": kill.commands},
        "details": {"ff": ff.extra, "kill": kill.extra},
    }


# ---- entry points ---------------------------------------------------------------------


def run(quick: bool, out_dir: Path, shards: int = 1) -> dict[str, Any]:
    """Runs failure-free and kill under torchft and titan_recover; returns the results."""
    import torchft  # noqa: F401  fails at once if the bench extra (torchft) is missing

    setup = Setup(steps=20, fault_step=8, shards=shards) if quick else Setup(steps=40, fault_step=15, shards=shards)
    started = time.monotonic()
    systems = {}
    for name, runner in (("torchft", run_torchft), ("titan_recover", run_recover)):
        ff = runner(setup, "none", out_dir / f"{name}_ff")
        kill = runner(setup, setup.fault_plan, out_dir / f"{name}_kill")
        systems[name] = analyze(setup, ff, kill)
    short = {"torchft": "torchft", "titan_recover": "recover"}
    top = {
        f"{short[n]}_{k}": systems[n][k]
        for n in systems
        for k in ("max_rel_loss_dev", "samples_skipped", "samples_repeated", "recovery_s", "median_ff_step_s")
    }
    for n, r in systems.items():  # per step, step 1 first; None where the kill run did not commit
        top[f"{short[n]}_rel_loss_dev"] = [row["rel_dev"] for row in r["per_step"]]
        top[f"{short[n]}_global_batch"] = r["global_batch_per_step"]
    return {
        **top,
        "commands": {n: r["commands"] for n, r in systems.items()},
        "setup": {
            **asdict(setup),
            "num_microbatches": setup.num_microbatches,
            "fault_plan": setup.fault_plan,
            "config": str(CONFIG.relative_to(ROOT)),
            "model": "llama3_recover (torchft: llama3_recover_torchft, "
            "the same spec with FSDP on a one-rank mesh so TorchTitan's all-reduce hook reaches torchft)",
            "torchft": "TorchTitan's FTTrainer (torchtitan/experiments/ft/train.py), torchft Lighthouse "
            "(min_replicas 1), torchft ProcessGroupGloo, async quorum; the killed group is not restarted",
            "titan_recover": "titan_recover.launch, [recover] max_restarts = 0",
            "recovery_s": "wall time from the SIGKILL to the end of the survivors' first committed step after it",
            "versions": {
                "torch": torch.__version__,
                "torchft": _version("torchft"),
                "torchtitan": _version("torchtitan"),
            },
            "install": "pip install torchft==0.2.0  (keeps torch 2.13.0+cpu; "
            "adds torchft, opentelemetry-* and googleapis-common-protos)",
        },
        "systems": systems,
        "wall_s": round(time.monotonic() - started, 1),
    }


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _fmt(x: float | None, spec: str) -> str:
    return format(x, spec) if x is not None else format("-", ">" + spec.split(".")[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 steps, kill at step 8 (else 40, kill at 15)")
    parser.add_argument("--shards", type=int, default=1, choices=(1, 2), help="FSDP ranks per replica group")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fidelity_") as tmp:
        result = run(args.quick, Path(tmp), args.shards)
    path = write_result("fidelity", result)
    s = result["setup"]
    print(
        f"\n{s['replicas']} replica groups x {s['shards']} FSDP ranks, llama3 {s['flavor']}, {s['steps']} steps, "
        f"{s['global_batch']} samples/step; {s['fault_plan']}; no restart"
    )
    print(
        f"{'system':14s} {'max rel dev':>11s} {'skipped':>8s} {'repeated':>8s} {'recovery s':>10s} "
        f"{'ff step s':>9s} {'committed':>9s}  samples per step from step {s['fault_step']}"
    )
    for name, r in result["systems"].items():
        batch = r["global_batch_per_step"][s["fault_step"] - 1 :]
        print(
            f"{name:14s} {r['max_rel_loss_dev']:11.2e} {r['samples_skipped']:8d} {r['samples_repeated']:8d} "
            f"{_fmt(r['recovery_s'], '10.3f')} {r['median_ff_step_s']:9.3f} {r['steps_committed']:9d}  "
            f"{batch}"
        )
    print(f"wrote {path} ({result['wall_s']:.0f}s)")


if __name__ == "__main__":
    main()
