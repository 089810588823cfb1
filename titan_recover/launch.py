"""The launcher behind ``run_train.sh``: coordinator + one torchrun job per replica group.

``[recover] enable = true``: starts the coordinator (unless ``$TITAN_RECOVER_COORDINATOR``
points at one on another node), then R ``torchrun`` jobs of ``dp_shard`` ranks each,
and reports a group whose torchrun exits abnormally, which shortens detection.
``enable = false``: one ``torchrun`` world of R x dp_shard ranks, stock TorchTitan HSDP.
Either way the run ends with a summary from ``recover_events.jsonl``.
"""

import os
import subprocess
import sys
import time

from titan_recover import config, store
from titan_recover.dataloader import token_file_for
from titan_recover.events import events_path
from titan_recover.summary import format_summary, summarize_events

REPLICAS_ENV = "TITAN_RECOVER_REPLICAS"  # comma-separated replica ids this node launches


def log(msg: str) -> None:
    print(f"[titan_recover launcher] {msg}", flush=True)


def torchrun(nproc: int, argv: list[str], role: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", f"--nproc_per_node={nproc}",
        "--max_restarts", "0", "--role", role, "--tee", "3", "--local-ranks-filter", "0",
        "-m", "titan_recover.train", *argv,
    ]


def run_stock(job_config: object, argv: list[str]) -> int:
    par = job_config.parallelism  # type: ignore[attr-defined]
    nproc = par.data_parallel_replicate_degree * par.data_parallel_shard_degree
    log(f"[recover] enable = false: stock TorchTitan HSDP, {nproc} ranks in one torchrun world")
    return subprocess.call(torchrun(nproc, argv, "hsdp"))


def run_recover(job_config: object, argv: list[str]) -> int:
    rc = job_config.recover  # type: ignore[attr-defined]
    par = job_config.parallelism  # type: ignore[attr-defined]
    replicas = par.data_parallel_replicate_degree
    local = [int(r) for r in os.environ.get(REPLICAS_ENV, ",".join(map(str, range(replicas)))).split(",")]
    env = dict(os.environ)
    coordinator = None
    if store.COORDINATOR_ENV not in env:
        env[store.COORDINATOR_ENV] = f"127.0.0.1:{rc.coordinator_port or store.free_port()}"
        coordinator = subprocess.Popen([sys.executable, "-m", "titan_recover.coordinator", *argv], env=env)
    address = env[store.COORDINATOR_ENV]
    client = store.connect(address, timeout_s=60)
    log(
        f"coordinator at {address}; starting replica groups {local} of {replicas}, "
        f"{par.data_parallel_shard_degree} FSDP ranks each"
    )
    groups = {
        r: subprocess.Popen(
            torchrun(par.data_parallel_shard_degree, argv, f"replica{r}"),
            env={**env, store.REPLICA_ENV: str(r)},
        )
        for r in local
    }
    reported: set[int] = set()
    try:
        while True:
            for r, proc in groups.items():
                code = proc.poll()
                if code not in (None, 0) and r not in reported:
                    reported.add(r)
                    store.report(client, {"replica": r, "epoch": -1, "suspect": r, "cause": f"torchrun of replica {r} exited with code {code}"})
            if coordinator is not None and coordinator.poll() is not None:
                break
            if coordinator is None and all(p.poll() is not None for p in groups.values()):
                break
            time.sleep(0.05)
        status = coordinator.returncode if coordinator is not None else max(p.returncode for p in groups.values() if p.returncode is not None)
        deadline = time.monotonic() + 30
        for proc in groups.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        return status
    finally:
        for proc in [*groups.values(), coordinator]:
            if proc is not None and proc.poll() is None:
                proc.kill()


def main(argv: list[str]) -> int:
    try:
        job_config = config.load(argv)
    except config.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    token_file_for(job_config)  # prepare the data once, before any rank needs it
    path = events_path(job_config.job.dump_folder)
    if os.path.exists(path):
        os.remove(path)
    start = time.time()
    code = (run_recover if job_config.recover.enable else run_stock)(job_config, argv)
    tr, par = job_config.training, job_config.parallelism
    if os.path.exists(path):
        print(format_summary(summarize_events(path), tr.global_batch_size * tr.seq_len), flush=True)
    log(f"{'finished' if code == 0 else 'FAILED'} in {time.time() - start:.1f}s; events: {path}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
