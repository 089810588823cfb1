"""The cluster launch scripts: the Slurm batch script's syntax and dry run, the Kubernetes manifest."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml

from conftest import CONFIG, ROOT

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"


def dry_run(nodes: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TITAN_RECOVER_"))}
    return subprocess.run(["bash", str(SBATCH), *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**clean, "DRY_RUN": "1", "DRY_RUN_NODES": nodes, **env})


def test_the_batch_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


@pytest.mark.parametrize("nodes,groups,spares", [("n1 n2", "1", "0"), ("a b c", "2", "1")])
def test_the_dry_run_prints_one_launcher_per_node(nodes: str, groups: str, spares: str) -> None:
    out = dry_run(nodes, str(CONFIG), "--training.steps", "100", GROUPS_PER_NODE=groups, SPARES=spares)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("node ")]
    hosts, g = nodes.split(), int(groups)
    assert len(lines) == len(hosts)
    secrets, ids = set(), []
    for i, line in enumerate(lines):
        env = dict(re.findall(r"(\w+)=(\S+)", line.split("./run_train.sh")[0]))
        secrets.add(env["TITAN_RECOVER_SECRET"])
        ids += [int(r) for r in env["TITAN_RECOVER_REPLICAS"].split(",")]
        assert env["CONFIG_FILE"] == str(CONFIG)
        assert ("TITAN_RECOVER_COORDINATOR" in env) == (i > 0)  # node 0 starts the coordinator
        if i:
            assert env["TITAN_RECOVER_COORDINATOR"] == f"{hosts[0]}:29510"
        replicas = len(hosts) * g - int(spares)
        assert f"--parallelism.data_parallel_replicate_degree {replicas} --recover.spares {spares} " in line
        assert line.endswith("--training.steps 100")
    assert len(secrets) == 1 and len(next(iter(secrets))) == 32  # one secret for the run
    assert ids == list(range(len(hosts) * g))  # the replica ids, split among the nodes


@pytest.mark.parametrize("args,env,message", [
    (["missing.toml"], {}, "config file 'missing.toml' not found"),
    ([str(CONFIG)], {"GROUPS_PER_NODE": "0"}, "GROUPS_PER_NODE=0"),
    ([str(CONFIG)], {"SPARES": "2"}, "leave no member after SPARES=2"),
    ([str(CONFIG)], {"TITAN_RECOVER_PORT": "x"}, "PORT=x must be a non-negative integer"),
])
def test_bad_input_stops_the_script_naming_it(args: list[str], env: dict[str, str], message: str) -> None:
    out = dry_run("n1 n2", *args, **env)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_outside_slurm_without_a_dry_run_it_says_how_to_submit() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DRY_RUN"))}
    out = subprocess.run(["bash", str(SBATCH), str(CONFIG)], cwd=ROOT, capture_output=True, text=True, env=clean, timeout=60)
    assert out.returncode == 2 and "not inside a Slurm allocation" in out.stderr


def test_the_kubernetes_manifest_is_an_indexed_job_with_a_headless_service() -> None:
    docs = list(yaml.safe_load_all((ROOT / "scripts" / "k8s" / "train-indexed-job.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Service", "Secret", "Job"}
    assert kinds["Service"]["spec"]["clusterIP"] == "None"
    job = kinds["Job"]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"]
    pod = job["template"]["spec"]
    assert pod["subdomain"] == kinds["Service"]["metadata"]["name"]
    script = pod["containers"][0]["args"][0]
    assert "TITAN_RECOVER_REPLICAS=$JOB_COMPLETION_INDEX" in script and "titan-recover-0.titan-recover:29510" in script
