"""The cluster launch scripts, without a cluster: the Slurm batch script (its dry run, and its real
path under a stand-in srun/scontrol), the per-node command scripts/node.sh, the Kubernetes manifest."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the package it was taken from, which titan_recover depends on
    import tomli as tomllib
from conftest import ROOT

from titan_recover.control.sealed import given_secret

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
NODE_SH = ROOT / "scripts" / "node.sh"
NODE_SLURM_SH = ROOT / "scripts" / "slurm" / "node_slurm.sh"  # node.sh sources it under Slurm
MANIFEST = ROOT / "scripts" / "k8s" / "train-indexed-job.yaml"
CFG = "train_configs/llama3_debug_cpu.toml"
GPU_CONFIGS = ["train_configs/llama3_8b_hsdp_gpu.toml", "train_configs/llama3_8b_hsdp_tp_gpu.toml"]
SCRIPTS_TOML = "the Slurm and Kubernetes scripts take the job as CONFIG_FILE, a TOML"
# what the scripts read from the environment: the tests' own values only
OURS = (
    "SLURM",
    "TITAN_RECOVER_",
    "DRY_RUN",
    "NODE_",
    "NUM_NODES",
    "COORDINATOR_",
    "GROUPS_PER_NODE",
    "GROUP_NODES",
    "SPARES",
    "GPUS_PER_NODE",
    "RANKS_PER_GROUP",
    "CONFIG_FILE",
    "PLAN_ONLY",
    "SHOW_SECRET",
    "VENV",
    "EXTRAS",
    "PYTHON",
    "CONTROL_STORE",
)


def clean_env(**env: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith(OURS)}, **env}


def sh(script: Path | str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=clean_env(**env)
    )


def slurm_stand_ins(folder: Path, scripts: dict[str, str]) -> Path:
    """``folder`` laid out as a checkout holding node.sh and node_slurm.sh, with ``scripts`` (path -> bash body: the
    launcher's ``run_train.sh`` and Slurm's commands under ``bin/``) as executables; the folder of the commands."""
    (folder / "scripts" / "slurm").mkdir(parents=True)
    shutil.copy(NODE_SH, folder / "scripts" / "node.sh")
    shutil.copy(NODE_SLURM_SH, folder / "scripts" / "slurm" / "node_slurm.sh")
    (folder / "c.toml").write_text("")
    (folder / "bin").mkdir()
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (folder / name).chmod(0o755)
    return folder / "bin"


def called(record: Path) -> list[str]:
    """The job ids a stand-in command (scancel, scontrol requeue) was given, in order; none if it never ran."""
    return record.read_text().split() if record.exists() else []


def dry_run(nodes: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return sh(SBATCH, *args, DRY_RUN="1", DRY_RUN_NODES=nodes, GPUS_PER_NODE=env.pop("GPUS_PER_NODE", "0"), **env)


@dataclass
class Node:
    """One ``node i (host): TITAN_RECOVER_SECRET=... env [-u VAR] VAR=... ./run_train.sh ARGS`` line."""

    index: int
    host: str
    env: dict[str, str]
    unset: list[str]
    args: list[str]

    @property
    def replicas(self) -> list[int]:
        return [int(r) for r in self.env["TITAN_RECOVER_REPLICAS"].split(",")]

    def arg(self, name: str) -> str:
        return self.args[self.args.index(name) + 1]


def nodes_in(stdout: str) -> list[Node]:
    nodes = []
    for line in stdout.splitlines():
        m = re.fullmatch(r"(?:\d+: )?node (\d+) \(([^,) ]+)(?:, [^)]*)?\): (.*)", line)  # srun --label prefixes "i: "
        if not m:
            continue
        words = shlex.split(m[3])  # the printed command reads back as the words it runs
        assert words[0].startswith("TITAN_RECOVER_SECRET=") and words[1] == "env", line
        env, unset, i = {"TITAN_RECOVER_SECRET": words[0].split("=", 1)[1]}, [], 2
        while words[i] != "./run_train.sh":
            if words[i] == "-u":
                unset.append(words[i + 1])
                i += 2
            else:
                key, _, value = words[i].partition("=")
                env[key] = value
                i += 1
        nodes.append(Node(int(m[1]), m[2], env, unset, words[i + 1 :]))
    return nodes


def check_layout(
    nodes: list[Node], hosts: list[str], groups: int, spares: int, coordinator: str, span: int = 1
) -> None:
    """One launcher per node; only node 0 starts the coordinator; one secret; the ids partitioned
    (each id over ``span`` nodes in a row, one part each)."""
    assert [(n.index, n.host) for n in nodes] == list(enumerate(hosts))
    for n in nodes:
        if n.index == 0:  # the launcher without TITAN_RECOVER_COORDINATOR starts it
            assert "TITAN_RECOVER_COORDINATOR" not in n.env and n.unset == ["TITAN_RECOVER_COORDINATOR"]
        else:
            assert n.env["TITAN_RECOVER_COORDINATOR"] == coordinator and not n.unset
        block = n.index // span
        assert n.replicas == list(range(block * groups, (block + 1) * groups))
        assert n.env["TITAN_RECOVER_GROUP_NODE"] == str(n.index % span) and n.arg("--recover.group_nodes") == str(span)
        assert int(n.arg("--parallelism.data_parallel_replicate_degree")) == len(hosts) // span * groups - spares
        assert int(n.arg("--recover.spares")) == spares
        assert n.arg("--recover.coordinator_port") == coordinator.rsplit(":", 1)[1]
        assert n.arg("--recover.coordinator_bind")
    secrets = {n.env["TITAN_RECOVER_SECRET"] for n in nodes}
    assert len(secrets) == 1 and re.fullmatch(r"[0-9a-f]{32}", secrets.pop())
    parts = sorted((r, int(n.env["TITAN_RECOVER_GROUP_NODE"])) for n in nodes for r in n.replicas)
    assert parts == [(r, k) for r in range(len(hosts) // span * groups) for k in range(span)]


def test_the_scripts_parse() -> None:
    for script in (SBATCH, NODE_SH, NODE_SLURM_SH):
        subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize(
    "hosts,groups,spares,span",
    [
        (["n1", "n2"], 1, 0, 1),
        (["a", "b", "c"], 2, 1, 1),
        (["x", "y", "z"], 3, 0, 1),
        (["n1", "n2", "n3", "n4"], 1, 0, 2),
        (["a", "b", "c", "d", "e", "f"], 2, 1, 3),  # groups that span nodes
    ],
)
def test_the_dry_run_prints_one_launcher_per_node(hosts: list[str], groups: int, spares: int, span: int) -> None:
    out = dry_run(
        " ".join(hosts),
        CFG,
        "--training.steps",
        "100",
        "--job.description",
        "two words",
        GROUPS_PER_NODE=str(groups),
        SPARES=str(spares),
        GROUP_NODES=str(span),
        CONTROL_STORE="tcpstore",  # from 3 nodes on the default is an etcd where there is one
    )
    assert out.returncode == 0, out.stderr
    nodes = nodes_in(out.stdout)
    check_layout(nodes, hosts, groups, spares, f"{hosts[0]}:29510", span)
    for n in nodes:
        assert n.env["CONFIG_FILE"] == CFG
        assert n.args[-4:] == ["--training.steps", "100", "--job.description", "two words"]
    assert "DRY_RUN: nothing started" in out.stdout
    assert "srun --nodes=%d --ntasks=%d --ntasks-per-node=1 " % (len(hosts), len(hosts)) in out.stdout


def test_from_three_nodes_on_the_default_control_store_is_an_etcd_on_the_nodes_where_etcd_is_installed(
    tmp_path: Path,
) -> None:
    """Unset ``CONTROL_STORE``: ``nodes`` on 3 or more nodes with an etcd on PATH; node 0's TCPStore on 2 nodes,
    or without one (each saying why, and what to install); ``tcpstore`` asks for the TCPStore on any number."""
    with_etcd, without = tmp_path / "with", tmp_path / "without"
    for folder in (with_etcd, without):  # every command on PATH but etcd; one of them has a stand-in etcd
        folder.mkdir()
        for directory in os.environ["PATH"].split(os.pathsep):
            for tool in Path(directory).glob("*") if Path(directory).is_dir() else ():
                if not tool.name.startswith("etcd") and not (folder / tool.name).exists():
                    (folder / tool.name).symlink_to(tool)
    (with_etcd / "etcd").write_text("#!/bin/sh\necho 'etcd Version: 3.4.23'\n")
    (with_etcd / "etcd").chmod(0o755)
    three = dry_run("c1 c2 c3", CFG, SLURM_JOB_ID="5", PATH=str(with_etcd))
    assert three.returncode == 0, three.stderr
    assert "an etcd member on each of c1 c2 c3 (nodes://c1,c2,c3)" in three.stdout
    assert all(n.arg("--recover.control_store") == "nodes://c1,c2,c3" for n in nodes_in(three.stdout))
    two = dry_run("c1 c2", CFG, PATH=str(with_etcd))
    assert "2 node(s) are too few for an etcd quorum" in two.stdout
    check_layout(nodes_in(two.stdout), ["c1", "c2"], 1, 0, "c1:29510")
    bare = dry_run("c1 c2 c3", CFG, PATH=str(without))
    assert "no etcd on PATH here, so node 0's loss stops the run; install etcd 3.4" in bare.stdout, bare.stdout
    check_layout(nodes_in(bare.stdout), ["c1", "c2", "c3"], 1, 0, "c1:29510")
    asked = dry_run("c1 c2 c3", CFG, PATH=str(with_etcd), CONTROL_STORE="tcpstore")
    assert "control store:" not in asked.stdout
    check_layout(nodes_in(asked.stdout), ["c1", "c2", "c3"], 1, 0, "c1:29510")


def test_the_defaults_one_group_per_cpu_node_and_a_fresh_secret_per_run() -> None:
    first, second = (dry_run("n1 n2", CFG) for _ in range(2))
    one, two = nodes_in(first.stdout), nodes_in(second.stdout)
    check_layout(one, ["n1", "n2"], 1, 0, "n1:29510")
    assert one[0].env["TITAN_RECOVER_SECRET"] != two[0].env["TITAN_RECOVER_SECRET"]
    assert one[0].arg("--recover.coordinator_bind") == "0.0.0.0"


def test_the_nodes_come_from_the_slurm_node_list(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(  # stands for `scontrol show hostnames LIST`
        '#!/usr/bin/env bash\n[ "$1 $2 $3" = "show hostnames gpu[07-09]" ] || { echo "unexpected: $*" >&2; exit 1; }\n'
        "printf '%s\\n' gpu07 gpu08 gpu09\n"
    )
    (fake / "scontrol").chmod(0o755)
    path = f"{fake}:{os.environ['PATH']}"
    out = sh(
        SBATCH,
        CFG,
        DRY_RUN="1",
        PATH=path,
        SLURM_JOB_NODELIST="gpu[07-09]",
        SLURM_NNODES="3",
        GPUS_PER_NODE="0",
        TITAN_RECOVER_PORT="31000",
        COORDINATOR_BIND="10.0.0.7",
        CONTROL_STORE="tcpstore",
    )
    assert out.returncode == 0, out.stderr
    nodes = nodes_in(out.stdout)
    check_layout(nodes, ["gpu07", "gpu08", "gpu09"], 1, 0, "gpu07:31000")
    assert {n.arg("--recover.coordinator_bind") for n in nodes} == {"10.0.0.7"}
    wrong = sh(SBATCH, CFG, DRY_RUN="1", PATH=path, SLURM_JOB_NODELIST="gpu[07-09]", SLURM_NNODES="4")
    assert wrong.returncode == 2 and "SLURM_NNODES=4 but the node list has 3 hosts" in wrong.stderr


@pytest.mark.toml(SCRIPTS_TOML)
def test_the_real_path_runs_node_sh_once_per_node_under_srun(tmp_path: Path) -> None:
    """sbatch's own path with a stand-in srun that runs its task on each node in turn, in plan-only
    mode: the same per-node commands as the dry run, and no secret in the batch script's log."""
    fake, venv = tmp_path / "bin", tmp_path / "venv"
    fake.mkdir()
    venv.mkdir()
    # an up-to-date stamp makes scripts/bootstrap.sh a no-op; PYTHON=false makes any install fail at once
    want = ((ROOT / "pyproject.toml").read_text() + "extras: torchtitan022,test\n").rstrip("\n")
    (venv / ".titan_recover-installed").write_text(want + "\n")
    (fake / "scontrol").write_text("#!/usr/bin/env bash\nprintf '%s\\n' c1 c2 c3\n")
    (fake / "srun").write_text(
        "#!/usr/bin/env bash\n"
        'printf "%s\\n" "$@" > "$FAKE_SRUN_ARGS"\n'
        "while [[ $1 == --* ]]; do shift; done\n"
        "for i in 0 1 2; do node=c$((i + 1)); SLURMD_NODENAME=$node "
        'PLAN_ONLY=1 SHOW_SECRET=1 "$@" | sed "s/^/$i: /" || exit; done\n'
    )
    for f in fake.iterdir():
        f.chmod(0o755)
    srun_args = tmp_path / "srun-args"
    out = sh(
        SBATCH,
        CFG,
        "--training.steps",
        "7",
        PATH=f"{fake}:{os.environ['PATH']}",
        SLURM_JOB_NODELIST="c[1-3]",
        SLURM_NNODES="3",
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_CPUS_ON_NODE="16",
        GPUS_PER_NODE="0",
        GROUPS_PER_NODE="2",
        VENV=str(venv),
        EXTRAS="test",
        PYTHON="false",
        FAKE_SRUN_ARGS=str(srun_args),
        CONTROL_STORE="tcpstore",
        TITAN_RECOVER_COORDINATOR="stale:1",
        NODE_INDEX="5",
        TITAN_RECOVER_SECRET_FILE=str(tmp_path / "secret"),  # not in the checkout's outputs/
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ignoring TITAN_RECOVER_COORDINATOR=stale:1" in out.stdout and "ignoring NODE_INDEX=5" in out.stdout
    plan = [line for line in out.stdout.splitlines() if line.startswith("node ")]
    ran = [line for line in out.stdout.splitlines() if re.match(r"\d: node ", line)]
    assert len(plan) == len(ran) == 3
    assert all("TITAN_RECOVER_SECRET='<hidden>'" in line for line in plan)  # the log has no secret
    nodes = nodes_in("\n".join(ran))  # what srun's tasks ran, each finding its index from its host name
    check_layout(nodes, ["c1", "c2", "c3"], 2, 0, "c1:29510")
    assert (tmp_path / "secret").read_text() == nodes[0].env["TITAN_RECOVER_SECRET"] + "\n"

    def unlabelled(line: str) -> str:
        return re.sub(r"SECRET=\S+", "SECRET=x", re.sub(r"^\d: ", "", line))

    assert [unlabelled(line) for line in plan] == [unlabelled(line) for line in ran]  # planned = run
    args = srun_args.read_text().splitlines()
    for flag in (
        "--ntasks-per-node=1",
        "--nodes=3",
        "--no-kill",
        "--kill-on-bad-exit=0",
        "--wait=0",
        "--export=ALL",
        "--cpus-per-task=16",
    ):
        assert flag in args
    assert args[args.index("./scripts/node.sh") :] == ["./scripts/node.sh", "--training.steps", "7"]


def sbatch_checkout(tmp_path: Path, commands: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """A copy of the Slurm scripts with the environment in place and a ``run_train.sh`` never run, Slurm's commands
    stood in by ``commands`` (name -> bash body; srun's gets the command after its options); the folder, and the
    environment of a job 1234 on hosts c1 and c2 run from it."""
    repo, fake = tmp_path / "repo", tmp_path / "bin"
    (repo / "scripts" / "slurm").mkdir(parents=True)
    fake.mkdir()
    for script in (SBATCH, NODE_SH, NODE_SLURM_SH):
        shutil.copy(script, repo / script.relative_to(ROOT))
    (repo / "scripts" / "bootstrap.sh").write_text("")  # the environment is there
    (repo / "run_train.sh").write_text("#!/usr/bin/env bash\nexit 1\n")
    (repo / "c.toml").write_text("")
    for name, body in commands.items():
        options = "while [[ $1 == --* ]]; do shift; done\n" if name == "srun" else ""
        (fake / name).write_text(f"#!/usr/bin/env bash\n{options}{body}\n")
    for f in (*fake.iterdir(), repo / "run_train.sh", *repo.glob("scripts/**/*.sh")):
        f.chmod(0o755)
    env = dict(
        PATH=f"{fake}:{os.environ['PATH']}",
        SLURM_SUBMIT_DIR=str(repo),
        DRY_RUN_NODES="c1 c2",  # the hosts, without scontrol
        GPUS_PER_NODE="0",
        SLURM_JOB_ID="1234",
    )
    return repo, env


def submit(repo: Path, **env: str) -> subprocess.CompletedProcess:
    """``train.sbatch c.toml`` as the batch script of a job run from ``repo``, umask 022."""
    return subprocess.run(
        ["bash", "-c", 'umask 022 && exec bash "$0" c.toml', str(repo / "scripts" / "slurm" / "train.sbatch")],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(**env),
    )


def test_a_node_that_left_the_job_on_a_failure_counts_only_where_the_nodes_still_in_it_wrote_their_status(
    tmp_path: Path,
) -> None:
    """A node that fails leaves the job (--no-kill), and Slurm kills its tasks once it answers again: srun exits
    137. The job's status is then the worst of the nodes still in it, as each task wrote it (node_slurm.sh's
    exits/ folder); srun's where one of them wrote none, or where no node left the job. Stand-ins: srun writes the
    given statuses and exits 137, scontrol shows the job's node list now."""
    wrote = 'for n in $WROTE; do echo "${n#*=}" > "$TITAN_RECOVER_EXITS_DIR/${n%=*}"; done; exit 137'
    scontrol = (
        'case "$1 $2" in "show job") echo "JobId=1234 NodeList=$KEPT Restarts=0" ;;'
        ' "show hostnames") tr , "\\n" <<< "$3" ;; *) exit 1 ;; esac'
    )
    repo, job = sbatch_checkout(tmp_path, {"srun": wrote, "scontrol": scontrol})
    for kept, statuses, status in [("c1", "c1=0", 0), ("c1", "c1=3", 3), ("c1", "", 137), ("c1,c2", "c1=0 c2=0", 137)]:
        ended = submit(repo, **job, KEPT=kept, WROTE=statuses)
        assert ended.returncode == status, (kept, statuses, ended.stdout, ended.stderr)
        left = "c2 left the job on a node failure" in ended.stdout
        assert left == (statuses != "" and kept == "c1"), ended.stdout
    assert sorted(p.name for p in (repo / "outputs" / "slurm" / "1234" / "job1234.exits").iterdir()) == ["c1", "c2"]


def test_the_runs_secret_is_saved_for_the_user_alone_and_a_requeue_a_joining_job_and_drain_find_it(
    tmp_path: Path,
) -> None:
    """A job that makes its run's secret saves it in outputs/slurm/<job id>/secret of the submit directory (mode
    0600 in a 0700 folder whatever the umask; the log names the path, never the secret). The same job requeued
    reads it back, a JOIN_RUN job of that run id finds it with no secret given, and drain's reader takes the same
    file; a JOIN_RUN job of a run with no such file stops naming it. In a copy of the scripts whose srun runs
    each node's plan only."""
    plan_only = (
        'for i in 0 1; do SLURMD_NODENAME=c$((i + 1)) PLAN_ONLY=1 SHOW_SECRET=1 "$@" | sed "s/^/$i: /" || exit; done'
    )
    repo, job = sbatch_checkout(tmp_path, {"srun": plan_only})

    def submitted(**env: str) -> subprocess.CompletedProcess:
        return submit(repo, **{**job, **env})

    def secrets(out: subprocess.CompletedProcess) -> set[str]:
        """The secrets srun's tasks were given."""
        return {
            n.env["TITAN_RECOVER_SECRET"] for n in nodes_in(out.stdout) if n.env["TITAN_RECOVER_SECRET"] != "<hidden>"
        }

    first = submitted()
    assert first.returncode == 0, first.stdout + first.stderr
    saved = repo / "outputs" / "slurm" / "1234" / "secret"
    secret = saved.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{32}", secret)
    assert (saved.stat().st_mode & 0o777, saved.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    assert secrets(first) == {secret}
    said = [line for line in first.stdout.splitlines() if not re.match(r"\d: ", line)]  # the batch script's own log
    assert f"the run's secret is saved in {saved} (mode 0600)" in first.stdout and secret not in "\n".join(said)
    requeued = submitted()
    assert requeued.returncode == 0, requeued.stderr
    assert f"the run's secret: from {saved}" in requeued.stdout
    assert secrets(requeued) == {secret}
    joining = dict(DRY_RUN="1", DRY_RUN_NODES="c9", SLURM_JOB_ID="1300", JOIN_RUN="c1:29510")
    joined = submitted(**joining, TITAN_RECOVER_RUN_ID="1234")
    assert joined.returncode == 0, joined.stderr
    [node] = nodes_in(joined.stdout)
    assert (node.env["TITAN_RECOVER_SECRET"], node.env["TITAN_RECOVER_REPLICAS"]) == (secret, "any:1")
    assert given_secret({"TITAN_RECOVER_SECRET_FILE": str(saved)}) == secret  # drain's and the launcher's reader
    with pytest.raises(ValueError, match="TITAN_RECOVER_SECRET_FILE=/nowhere: cannot read the run's secret"):
        given_secret({"TITAN_RECOVER_SECRET_FILE": "/nowhere"})
    unknown = submitted(**joining, TITAN_RECOVER_RUN_ID="999")
    assert unknown.returncode == 2 and f"no secret for run 999 in {repo}/outputs/slurm/999/secret" in unknown.stderr


def test_node_sh_runs_run_train_sh_with_that_environment(tmp_path: Path) -> None:
    """node.sh's exec, in a copy of the repository whose run_train.sh records what it was given."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(NODE_SH, tmp_path / "scripts" / "node.sh")
    (tmp_path / "c.toml").write_text("")
    (tmp_path / "run_train.sh").write_text(
        "#!/usr/bin/env bash\n"
        'echo "COORDINATOR=${TITAN_RECOVER_COORDINATOR-unset} REPLICAS=$TITAN_RECOVER_REPLICAS '
        'PART=$TITAN_RECOVER_GROUP_NODE CONFIG_FILE=$CONFIG_FILE SECRET=$TITAN_RECOVER_SECRET ARGS=$*"\n'
    )
    (tmp_path / "run_train.sh").chmod(0o755)
    base = dict(
        NUM_NODES="2",
        GROUPS_PER_NODE="2",
        COORDINATOR_ADDR="head:4000",
        CONFIG_FILE="c.toml",
        TITAN_RECOVER_SECRET="s3",
        TITAN_RECOVER_COORDINATOR="inherited:1",
    )
    ran = [sh(tmp_path / "scripts" / "node.sh", "--x.y", "1", NODE_INDEX=str(i), **base) for i in (0, 1)]
    assert [r.returncode for r in ran] == [0, 0], [r.stderr for r in ran]
    last = [r.stdout.splitlines()[-1] for r in ran]
    tail = (
        "PART=0 CONFIG_FILE=c.toml SECRET=s3 ARGS=--parallelism.data_parallel_replicate_degree 4 --recover.spares 0 "
        "--recover.group_nodes 1 --recover.coordinator_bind 0.0.0.0 --recover.coordinator_port 4000 --x.y 1"
    )
    assert last == [f"COORDINATOR=unset REPLICAS=0,1 {tail}", f"COORDINATOR=head:4000 REPLICAS=2,3 {tail}"]
    assert "s3" not in ran[0].stdout.splitlines()[0]  # its own log line hides the secret


@pytest.mark.parametrize(
    "node, batch_host_state, job_nodes, ends",
    [
        ("node1", "alloc", "node0 node1", False),  # the batch host is well: its script ends the job
        ("node1", "alloc*", "node0 node1", True),  # not responding: nothing will end the job
        ("node1", "idle", "node1", True),  # removed from the job (and repaired since)
        ("node2", "down*", "node0 node1 node2", False),  # not the first node left
        ("node1", "down*", "", False),  # the job ended already, or Slurm did not answer
    ],
)
def test_on_etcd_the_first_node_left_ends_a_job_whose_batch_host_is_lost(
    tmp_path: Path, node: str, batch_host_state: str, job_nodes: str, ends: bool
) -> None:
    """node.sh's decision under Slurm (``scripts/slurm/node_slurm.sh``) once its launcher has ended, from what
    Slurm's commands (stand-ins here) say: the real path runs in tests/test_slurm.py."""
    fake = slurm_stand_ins(
        tmp_path,
        {
            "run_train.sh": "exit 0",
            "bin/sinfo": f"echo '{batch_host_state}'",
            "bin/squeue": f"echo '{job_nodes}'",
            "bin/scontrol": 'printf "%s\\n" $3',  # `scontrol show hostnames LIST`: here LIST is the names
            "bin/scancel": f'echo "$@" >> {tmp_path}/cancelled',
        },
    )
    ran = sh(
        tmp_path / "scripts" / "node.sh",
        SLURMD_NODENAME=node,
        NODE_LIST="node0 node1 node2",
        SLURM_JOB_ID="77",
        CONTROL_STORE="etcd://e1:2379,e2:2379,e3:2379",
        CONFIG_FILE="c.toml",
        TITAN_RECOVER_SECRET="s",
        TITAN_RECOVER_RUN_ID="77",
        PATH=f"{fake}:{os.environ['PATH']}",
    )
    assert ran.returncode == 0, ran.stderr
    assert called(tmp_path / "cancelled") == (["77"] if ends else []), ran.stdout
    assert ("lost its batch host node0" in ran.stdout) == ends


@pytest.mark.parametrize(
    "code, preempt_time, requeues",
    [
        (5, "2026-01-02T03:04:05", False),  # preempted: the run stopped, and Slurm requeues the job itself
        (3, "2026-01-02T03:04:05", False),  # preempted, the coordinator gone first: still Slurm's requeue alone
        (3, "None", True),  # the coordinator's node lost (down* to Slurm): node.sh requeues
        (5, "None", False),  # stopped on another notice: resubmitting is the user's call
    ],
)
def test_a_preempted_jobs_node_waits_for_slurms_requeue_and_requeues_nothing_itself(
    tmp_path: Path, code: int, preempt_time: str, requeues: bool
) -> None:
    """node.sh's decision under Slurm once node 1's launcher has ended, from what Slurm's commands (stand-ins here)
    say: where the job has a ``PreemptTime`` it waits until Slurm no longer has it RUNNING (here at once) and
    requeues nothing, whatever the exit code; the real path runs in tests/test_slurm.py."""
    job = f"JobId=77 JobState=RUNNING PreemptTime={preempt_time} EndTime=2026-01-02T03:04:25"
    fake = slurm_stand_ins(
        tmp_path,
        {
            "run_train.sh": f"exit {code}",
            "bin/sinfo": "echo 'down*'",
            "bin/squeue": "echo COMPLETING",
            "bin/scontrol": f'case $1 in show) [ "$2" = job ] && echo "{job}" ;; '
            f'requeue) echo "$2" >> {tmp_path}/requeued ;; esac',
        },
    )
    ran = sh(
        tmp_path / "scripts" / "node.sh",
        SLURMD_NODENAME="node1",
        NODE_LIST="node0 node1",
        SLURM_JOB_ID="77",
        COORDINATOR_ADDR="node0:29510",
        CONFIG_FILE="c.toml",
        TITAN_RECOVER_SECRET="s",
        PATH=f"{fake}:{os.environ['PATH']}",
    )
    assert ran.returncode == code, ran.stderr
    assert called(tmp_path / "requeued") == (["77"] if requeues else []), ran.stdout
    assert ("job 77 is preempted" in ran.stdout) == (preempt_time != "None"), ran.stdout


def test_groups_per_node_default_to_gpus_per_node_over_ranks_per_group() -> None:
    out = dry_run("n1 n2", CFG, GPUS_PER_NODE="8", RANKS_PER_GROUP="4")
    assert out.returncode == 0, out.stderr
    assert "GROUPS_PER_NODE=2: 8 GPUs per node / 4 ranks per group on a node" in out.stdout
    check_layout(nodes_in(out.stdout), ["n1", "n2"], 2, 0, "n1:29510")
    spanning = dry_run(
        "n1 n2 n3 n4", CFG, GPUS_PER_NODE="8", RANKS_PER_GROUP="32", GROUP_NODES="4", CONTROL_STORE="tcpstore"
    )  # TP 8 x PP 4
    assert spanning.returncode == 0, spanning.stderr
    assert "GROUPS_PER_NODE=1: 8 GPUs per node / 8 ranks per group on a node" in spanning.stdout
    check_layout(nodes_in(spanning.stdout), ["n1", "n2", "n3", "n4"], 1, 0, "n1:29510", span=4)
    uneven = dry_run("n1 n2", CFG, GPUS_PER_NODE="6", RANKS_PER_GROUP="4")
    assert (
        uneven.returncode == 2 and "6 GPUs per node do not hold a whole number of replica groups of 4" in uneven.stderr
    )


@pytest.mark.toml(SCRIPTS_TOML)
def test_ranks_per_group_are_read_from_the_config_and_its_overrides() -> None:
    """dp_shard 2 (the config) x tp 2 (an override) = 4 ranks: 8 GPUs hold 2 groups (runs TorchTitan's parser)."""
    venv = Path(sys.executable).parent.parent
    out = dry_run("n1 n2", CFG, "--parallelism.tensor_parallel_degree", "2", GPUS_PER_NODE="8", VENV=str(venv))
    assert out.returncode == 0, out.stderr
    assert "GROUPS_PER_NODE=2: 8 GPUs per node / 4 ranks per group on a node" in out.stdout
    assert [n.replicas for n in nodes_in(out.stdout)] == [[0, 1], [2, 3]]


@pytest.mark.toml(SCRIPTS_TOML)
@pytest.mark.parametrize("config", GPU_CONFIGS)
def test_the_8b_configs_fill_nodes_of_8_gpus(config: str) -> None:
    """``sbatch --nodes=2 --gpus-per-node=8 scripts/slurm/train.sbatch <8B config>`` (docs/multi-node.md) as its dry
    run: each node runs 8 GPUs' worth of replica groups (8 / the config's ranks per group, read by TorchTitan's
    parser) and the run's replicate degree is 2 nodes' worth; the coordinator's port and bind address, which the
    8B configs leave unset, come from the script."""
    par = tomllib.loads((ROOT / config).read_text())["parallelism"]
    ranks = par["data_parallel_shard_degree"] * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"]
    groups = 8 // ranks
    out = dry_run("n1 n2", config, GPUS_PER_NODE="8", VENV=str(Path(sys.executable).parent.parent))
    assert out.returncode == 0, out.stderr
    assert f"GROUPS_PER_NODE={groups}: 8 GPUs per node / {ranks} ranks per group on a node" in out.stdout
    plan = [line for line in out.stdout.splitlines() if line.startswith("node ")]
    assert [line.split(":")[0] for line in plan] == [f"node {i} (n{i + 1}, 8 GPUs" for i in range(2)]
    assert all(f"8 GPUs: {groups} x {ranks} ranks)" in line for line in plan)  # each node's plan with its GPUs
    nodes = nodes_in(out.stdout)
    check_layout(nodes, ["n1", "n2"], groups, 0, "n1:29510")  # replicate degree 2 x groups, ids by node
    assert all(n.env["CONFIG_FILE"] == config and len(n.replicas) * ranks == 8 for n in nodes)


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["missing.toml"], {}, "config file 'missing.toml' not found"),
        ([], {}, "config file '' not found"),
        ([CFG], {"GROUPS_PER_NODE": "0"}, "GROUPS_PER_NODE=0: every node runs at least one replica group"),
        ([CFG], {"GROUPS_PER_NODE": "two"}, "GROUPS_PER_NODE=two must be a non-negative integer"),
        ([CFG], {"SPARES": "2"}, "leave no member after SPARES=2"),
        ([CFG], {"TITAN_RECOVER_PORT": "x"}, "COORDINATOR_ADDR='n1:x' is not host:port"),
        ([CFG], {"TITAN_RECOVER_PORT": "70000"}, "is not host:port (port 1..65535)"),
        ([CFG, "--recover.spares", "1"], {}, "--recover.spares is set from the node layout here"),
        ([CFG, "--recover.group_nodes", "2"], {}, "--recover.group_nodes is set from the node layout here"),
        ([CFG], {"GROUP_NODES": "3"}, "GROUP_NODES=3 must be >= 1 and divide NUM_NODES=2"),
        (
            [CFG],
            {"GROUP_NODES": "2", "GPUS_PER_NODE": "8", "RANKS_PER_GROUP": "5"},
            "GROUP_NODES=2 must be a positive integer that divides the 5 ranks",
        ),
        (
            [CFG, "--parallelism.data_parallel_replicate_degree=4"],
            {},
            "--parallelism.data_parallel_replicate_degree is set",
        ),
        ([CFG], {"GPUS_PER_NODE": "8", "VENV": "/nonexistent"}, "set GROUPS_PER_NODE (or RANKS_PER_GROUP)"),
    ],
)
def test_bad_input_stops_the_script_naming_it(args: list[str], env: dict[str, str], message: str) -> None:
    out = dry_run("n1 n2", *args, **env)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not nodes_in(out.stdout) and "srun" not in out.stdout  # no node's command past the bad input


def test_outside_slurm_without_a_dry_run_it_says_how_to_submit() -> None:
    out = sh(SBATCH, CFG)
    assert out.returncode == 2 and "not inside a Slurm allocation" in out.stderr


def test_a_node_not_in_the_allocation_stops() -> None:
    out = sh(
        NODE_SH,
        NODE_LIST="n1 n2",
        SLURMD_NODENAME="n9",
        COORDINATOR_ADDR="n1:1",
        CONFIG_FILE=CFG,
        TITAN_RECOVER_SECRET="s",
        PLAN_ONLY="1",
    )
    assert out.returncode == 2 and 'this node (n9) is not in NODE_LIST="n1 n2"' in out.stderr


@pytest.mark.parametrize(
    "env, domain",
    [
        ({"SLURM_TOPOLOGY_ADDR": "top.leaf3.c1"}, "top.leaf3"),  # topology/tree: the switches down to the node
        ({"SLURM_TOPOLOGY_ADDR": "c1"}, None),  # no topology plugin: the node's name alone says no domain
        ({"SLURM_TOPOLOGY_ADDR": "top.leaf3.c1", "TITAN_RECOVER_FAILURE_DOMAIN": "rack-7"}, None),  # set: kept
        ({}, None),
    ],
)
def test_under_slurm_the_failure_domain_is_the_nodes_leaf_switch(env: dict[str, str], domain: str | None) -> None:
    """``SLURM_TOPOLOGY_ADDR`` up to the node name becomes ``TITAN_RECOVER_FAILURE_DOMAIN`` where that is unset (a set
    one reaches the launcher as it is, through node.sh's own environment)."""
    out = sh(
        NODE_SH,
        NODE_INDEX="0",
        NUM_NODES="2",
        COORDINATOR_ADDR="c1:29510",
        CONFIG_FILE=CFG,
        TITAN_RECOVER_SECRET="s",
        PLAN_ONLY="1",
        **env,
    )
    assert out.returncode == 0, out.stderr
    passed = re.findall(r"TITAN_RECOVER_FAILURE_DOMAIN=(\S+)", out.stdout)
    assert passed == ([] if domain is None else [domain]), out.stdout


@pytest.mark.parametrize(("hosts", "members"), [("c1 c2 c3 c4", "c1,c2,c3"), ("c1 c2 c3 c4 c5 c6", "c1,c2,c3,c4,c5")])
def test_control_store_nodes_puts_an_etcd_member_on_the_jobs_first_three_or_five_nodes(
    hosts: str, members: str
) -> None:
    """``CONTROL_STORE=nodes``: the batch script names the job's first 3 nodes (5 from 5 nodes on) as the run's
    etcd members, every node's launcher gets that ``nodes://`` store and the job's id, none binds a coordinator."""
    out = dry_run(hosts, CFG, CONTROL_STORE="nodes", SLURM_JOB_ID="88")
    assert out.returncode == 0, out.stderr
    url = f"nodes://{members}"
    assert f"control store: an etcd member on each of {members.replace(',', ' ')} ({url})" in out.stdout
    launches = [line for line in out.stdout.splitlines() if line.startswith("node ")]
    assert len(launches) == len(hosts.split()), out.stdout
    assert all(f"--recover.control_store {url}" in line and "coordinator_port" not in line for line in launches)
    assert all("TITAN_RECOVER_RUN_ID=88" in line for line in launches)
    few = dry_run("c1 c2", CFG, CONTROL_STORE="nodes")
    assert few.returncode == 2 and "CONTROL_STORE=nodes needs 3 or more nodes" in few.stderr and "has 2" in few.stderr


def test_with_an_etcd_control_store_every_node_names_it_and_none_binds_a_coordinator() -> None:
    url = "etcd://e1:2379,e2:2379,e3:2379"
    lines = [
        sh(
            NODE_SH,
            NODE_INDEX=str(i),
            NUM_NODES="2",
            CONTROL_STORE=url,
            CONFIG_FILE=CFG,
            TITAN_RECOVER_SECRET="s",
            TITAN_RECOVER_RUN_ID="job-7",
            PLAN_ONLY="1",
        ).stdout
        for i in (0, 1)
    ]
    for line in lines:
        assert (
            f"--recover.control_store {url}" in line
            and "coordinator_bind" not in line
            and "coordinator_port" not in line
        )
        assert "TITAN_RECOVER_RUN_ID=job-7" in line and "EXTRAS=etcd " in line  # the bootstrap adds its client
    assert "-u TITAN_RECOVER_COORDINATOR" in lines[0] and f"TITAN_RECOVER_COORDINATOR={url}" in lines[1]
    unnamed = sh(
        NODE_SH,
        NODE_INDEX="0",
        NUM_NODES="2",
        CONTROL_STORE=url,
        CONFIG_FILE=CFG,
        TITAN_RECOVER_SECRET="s",
        PLAN_ONLY="1",
    )
    assert unnamed.returncode == 2 and "TITAN_RECOVER_RUN_ID is not set: a run on etcd" in unnamed.stderr
    bad = sh(
        NODE_SH,
        NODE_INDEX="0",
        NUM_NODES="1",
        CONTROL_STORE="e1:2379",
        CONFIG_FILE=CFG,
        TITAN_RECOVER_SECRET="s",
        PLAN_ONLY="1",
    )
    assert bad.returncode == 2 and "CONTROL_STORE='e1:2379' must be etcd://" in bad.stderr


def test_a_job_joins_a_run_on_etcd_by_its_store_and_takes_free_ids() -> None:
    """``JOIN_RUN=etcd://...`` (what a run on etcd submits for a lost node): the node names that store and asks for
    free ids; it neither starts a run nor sets the layout, which comes with the arguments."""
    url = "etcd://n1:2379,n2:2379,n3:2379"
    env = dict(NODE_INDEX="0", NUM_NODES="1", GROUPS_PER_NODE="2", CONFIG_FILE=CFG, TITAN_RECOVER_SECRET="s")
    joined = sh(NODE_SH, "--parallelism.data_parallel_replicate_degree", "6", **env, JOIN_RUN=url,
                TITAN_RECOVER_RUN_ID="41", PLAN_ONLY="1")  # fmt: skip
    assert joined.returncode == 0, joined.stderr
    assert f"TITAN_RECOVER_COORDINATOR={url} " in joined.stdout and "TITAN_RECOVER_REPLICAS=any:2" in joined.stdout
    assert f"--recover.control_store {url} --parallelism.data_parallel_replicate_degree 6" in joined.stdout
    bad = sh(NODE_SH, **env, JOIN_RUN="n1", TITAN_RECOVER_RUN_ID="41", PLAN_ONLY="1")
    assert bad.returncode == 2 and "JOIN_RUN='n1' is not host:port or etcd://" in bad.stderr


def manifest() -> dict[str, dict]:
    docs = {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}
    assert set(docs) == {"Service", "Job"}
    return docs


@pytest.mark.unit
def test_the_kubernetes_manifest_is_an_indexed_job_behind_a_headless_service() -> None:
    docs = manifest()
    service, job = docs["Service"], docs["Job"]["spec"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": docs["Job"]["metadata"]["name"]}
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and job["backoffLimitPerIndex"] >= 1  # the API requires Never for it
    assert job["podReplacementPolicy"] == "Failed"  # the API requires it with podFailurePolicy
    left = [r for r in job["podFailurePolicy"]["rules"] if r.get("onExitCodes", {}).get("values") == [4, 5]]
    assert left and left[0]["action"] == "Ignore"  # left (4), or stopped in order (5): replaced, uncounted
    never = [r for r in job["podFailurePolicy"]["rules"] if r.get("onExitCodes", {}).get("values") == [2, 6]]
    assert never and never[0]["action"] == "FailIndex"  # bad input (2), quarantined ids (6): no new pod helps
    assert pod["terminationGracePeriodSeconds"] > 12  # above recover.notice_budget_s's default
    assert pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert int(env["NUM_NODES"]["value"]) == job["completions"]
    assert env["TITAN_RECOVER_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "titan-recover", "key": "secret"}
    pods = [f"{docs['Job']['metadata']['name']}-{i}.{service['metadata']['name']}" for i in range(3)]
    assert env["CONTROL_STORE"]["value"] == "nodes://" + ",".join(pods)  # pods 0-2 by their DNS names
    assert "COORDINATOR_ADDR" not in env and job["completions"] >= 3  # no node special: a quorum survives one loss
    ports = {p["port"] for p in service["spec"]["ports"]}
    assert ports == {p["containerPort"] for p in container["ports"]} == {2379, 2380}  # etcd's client and peer
    assert (ROOT / env["CONFIG_FILE"]["value"]).is_file()


def test_each_kubernetes_pod_runs_its_node_command() -> None:
    """Every pod's command (node.sh) with the pod's environment, in plan-only mode, index 0..n-1."""
    docs = manifest()
    job = docs["Job"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    secret = "0123456789abcdef0123456789abcdef"
    lines = []
    for i in range(job["completions"]):
        env = {}
        for e in container["env"]:
            ref = e.get("valueFrom", {})
            if e["name"] == "TITAN_RECOVER_RUN_ID":  # the Job's uid: the same in every pod, a new one per Job
                assert ref["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/controller-uid']"
                env[e["name"]] = "2f6c3b8e-uid"
            elif e["name"] == "TITAN_RECOVER_FAILURE_DOMAIN":  # the node's zone label, once copied onto the pod
                assert ref["fieldRef"]["fieldPath"] == "metadata.labels['topology.kubernetes.io/zone']"
                env[e["name"]] = f"zone-{i % 2}"
            elif "fieldRef" in ref:
                assert (
                    ref["fieldRef"]["fieldPath"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                )
                env[e["name"]] = str(i)
            elif "secretKeyRef" in ref:
                env[e["name"]] = secret
            else:
                env[e["name"]] = e["value"]
        assert container["command"] == ["./scripts/node.sh"]
        out = subprocess.run(
            [*container["command"], *container["args"]],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(**env, PLAN_ONLY="1", SHOW_SECRET="1", HOSTNAME=f"pod{i}"),
        )
        assert out.returncode == 0, out.stderr
        lines.append(out.stdout)
    nodes = nodes_in("".join(lines))
    groups = int(next(e["value"] for e in container["env"] if e["name"] == "GROUPS_PER_NODE"))
    store = next(e["value"] for e in container["env"] if e["name"] == "CONTROL_STORE")
    assert [(n.index, n.host) for n in nodes] == [(i, f"pod{i}") for i in range(job["completions"])]
    for n in nodes:  # every pod names the run's nodes:// store and binds no coordinator; pod 0 begins the run
        assert n.arg("--recover.control_store") == store and "--recover.coordinator_port" not in n.args
        assert n.env["TITAN_RECOVER_RUN_ID"] == "2f6c3b8e-uid" and "etcd" in n.env["EXTRAS"].split(",")
        assert n.unset == ["TITAN_RECOVER_COORDINATOR"] if n.index == 0 else n.env["TITAN_RECOVER_COORDINATOR"] == store
        assert n.replicas == list(range(n.index * groups, (n.index + 1) * groups))
        assert int(n.arg("--parallelism.data_parallel_replicate_degree")) == len(nodes) * groups
    assert len({n.env["TITAN_RECOVER_SECRET"] for n in nodes}) == 1
