"""Growth over a long run: the control store's keys (TCPStore) and etcd's database (issue 27, n).

Runs the default job for at least ``--min-steps`` steps and ``--min-seconds`` seconds on the
coordinator's TCPStore and on a local 3-member etcd cluster, side by side, with a group killed
once in each third of the run, and samples the number of keys (and, on etcd, the database size)
every ``--every`` seconds. The growth in the last third is (end - two thirds) / two thirds, by step.

    .venv/bin/python -m bench.growth [--min-steps 3000] [--min-seconds 3600]

Writes bench/results/growth.json; runs live in outputs/growth/.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from bench.common import CONFIG, PRECISION, RESULTS, ROOT
from titan_recover.control import keys
from titan_recover.control.addresses import parse_etcd_url
from titan_recover.control.etcd_store import EtcdStore
from titan_recover.control.transport import free_port
from titan_recover.observability import logs
from titan_recover.tools.etcd_local import LocalEtcd

OUT = ROOT / "outputs" / "growth"
log = logging.getLogger(__name__)
# two groups of one rank: the control plane does per step what the default job does, at half its compute
JOB = [
    *PRECISION,
    "--parallelism.data_parallel_shard_degree",
    "1",
    "--training.global_batch_size",
    "8",
    "--metrics.log_freq",
    "50",
    "--recover.digest_interval",
    "50",
]


def growth(samples: list[dict], what: str) -> float:
    """(value at the last sample - value at two thirds of the steps) / value at two thirds."""
    last = samples[-1]
    two_thirds = min(samples, key=lambda s: abs(s["step"] - 2 * last["step"] / 3))
    return round((last[what] - two_thirds[what]) / max(1, two_thirds[what]), 4)


def steps_logged(dump: Path) -> int:
    return sum(f.read_text().count('"event": "step"') for f in dump.glob("recover_events*.jsonl"))


@dataclass
class Soak:
    """One run of the default job, from outside: started, sampled, stopped."""

    name: str
    steps: int
    faults_within: int
    extra: list[str]
    env: dict[str, str]
    dump: Path = field(init=False)
    proc: subprocess.Popen | None = None
    samples: list[dict] = field(default_factory=list)

    def start(self) -> None:
        self.dump = OUT / self.name
        shutil.rmtree(self.dump, ignore_errors=True)
        self.dump.mkdir(parents=True)
        kills = "; ".join(
            f"kill replica=1 rank=0 step={s} phase=backward attempt={i}"
            for i, s in enumerate((self.faults_within // 6, self.faults_within // 2, 5 * self.faults_within // 6))
        )
        cmd = [
            sys.executable,
            "-m",
            "titan_recover.launch",
            "--job.config_file",
            str(CONFIG),
            "--job.dump_folder",
            str(self.dump),
            *JOB,
            "--training.steps",
            str(self.steps),
            "--recover.fault_plan",
            kills,
            "--recover.max_restarts",
            "10",
            *self.extra,
        ]
        self.command = " ".join(cmd)
        with (self.dump / "launcher.log").open("w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def stop(self) -> int | None:
        """Ends the run (its own process group, which it was started in)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def tcp_keys(port: int) -> dict:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return {"keys": len(store.list_keys())}


def etcd_size(url: str) -> dict:
    store = EtcdStore(parse_etcd_url(url), 10)
    status = store.post("maintenance/status", {})
    count = store.post("kv/range", {"key": "AA==", "range_end": "AA==", "count_only": True})  # every key
    return {
        "keys": int(count.get("count", 0)),
        "db_size": int(status["dbSize"]),
        "db_size_in_use": int(status.get("dbSizeInUse", status["dbSize"])),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-steps", type=int, default=3000)
    p.add_argument("--min-seconds", type=float, default=3600)
    p.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    p.add_argument("--out", default=str(RESULTS / "growth.json"))
    args = p.parse_args(argv)
    logs.setup("bench", __name__, "bench")
    port = free_port()
    etcd = LocalEtcd(3).start()
    base = {k: v for k, v in os.environ.items() if k not in (keys.SECRET_ENV, keys.COORDINATOR_ENV, keys.RUN_ENV)}
    steps = 100 * args.min_steps  # ended from here once both bounds are reached
    soaks = {
        "tcp": (
            Soak(
                "tcp",
                steps,
                args.min_steps,
                ["--recover.coordinator_port", str(port)],
                {**base, "PYTHONUNBUFFERED": "1"},
            ),
            lambda: tcp_keys(port),
        ),
        "etcd": (
            Soak(
                "etcd",
                steps,
                args.min_steps,
                ["--recover.control_store", etcd.url],
                {**base, "PYTHONUNBUFFERED": "1", keys.SECRET_ENV: os.urandom(16).hex(), keys.RUN_ENV: "growth"},
            ),
            lambda: etcd_size(etcd.url),
        ),
    }
    start = time.monotonic()
    codes: dict[str, int | None] = {}
    try:
        for soak, _ in soaks.values():
            soak.start()
        while True:
            time.sleep(args.every)
            elapsed = time.monotonic() - start
            for name, (soak, sample) in soaks.items():
                if soak.proc is not None and soak.proc.poll() is not None:
                    raise RuntimeError(
                        f"the {name} run ended early (exit {soak.proc.returncode}): see {soak.dump}/launcher.log"
                    )
                try:
                    soak.samples.append({"t": round(elapsed), "step": steps_logged(soak.dump), **sample()})
                except Exception as e:  # one missed sample is not the run's failure
                    log.warning(f"{name}: no sample at {elapsed:.0f}s ({e})")
                    continue
                log.info(f"{name}: {soak.samples[-1]}")
            if elapsed >= args.min_seconds and all(
                s.samples and s.samples[-1]["step"] >= args.min_steps for s, _ in soaks.values()
            ):
                break
    finally:
        for name, (soak, _) in soaks.items():
            codes[name] = soak.stop()
        etcd.stop()
    tcp, on_etcd = soaks["tcp"][0], soaks["etcd"][0]
    result = {
        "issue": 27,
        "store_keys_growth_last_third": growth(tcp.samples, "keys"),
        "etcd_db_growth_last_third": growth(on_etcd.samples, "db_size"),
        "etcd_db_in_use_growth_last_third": growth(on_etcd.samples, "db_size_in_use"),
        "etcd_keys_growth_last_third": growth(on_etcd.samples, "keys"),
        "wall_s": round(time.monotonic() - start),
        "steps": {"tcp": tcp.samples[-1]["step"], "etcd": on_etcd.samples[-1]["step"]},
        "precision": "float32",
        "job": "llama3 debugmodel, 2 replica groups x 1 rank, global batch 8 (M = 4), a group killed at 1/6, 1/2, 5/6",
        "command": f"python -m bench.growth --min-steps {args.min_steps} --min-seconds {args.min_seconds:g}",
        "run_commands": {"tcp": tcp.command, "etcd": on_etcd.command},
        "samples": {"tcp": tcp.samples, "etcd": on_etcd.samples},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    log.info(
        f"growth in the last third: TCPStore keys {result['store_keys_growth_last_third']:+.2%}, etcd DB "
        f"{result['etcd_db_growth_last_third']:+.2%} (in use {result['etcd_db_in_use_growth_last_third']:+.2%}); "
        f"{result['steps']} steps in {result['wall_s']}s -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
