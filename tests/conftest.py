"""Runs real titan_recover jobs (coordinator + torchrun replica groups) for the tests."""

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import forked_launcher
import pytest
from filelock import FileLock

from titan_recover.compare import compare_runs
from titan_recover.control import etcd_process, keys, transport
from titan_recover.observability.events import of_kind
from titan_recover.titan.jobs import LINE, job
from titan_recover.tools import etcd_local

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    returncode: int
    output: str
    events: list[dict]

    def of(self, kind: str) -> list[dict]:
        return of_kind(self.events, kind)

    def steps(self) -> dict[int, dict]:
        steps: dict[int, dict] = {}
        for e in self.of("step"):
            assert e["step"] not in steps, f"step {e['step']} logged twice"
            steps[e["step"]] = e
        return steps


DURATIONS = json.loads((ROOT / "tests" / "durations.json").read_text())
"""Each test file's measured seconds (``scripts/test_durations.py`` writes it from a ``--durations=0`` run): run
with ``--dist loadfile --no-loadscope-reorder``, the workers start on the longest files and the suite ends on
short ones, not on a long file queued last behind a worker's other files. A file not listed counts as 0 s."""


NO_ETCD = etcd_process.unavailable()
"""Why this machine has no etcd the tests may start (none on ``PATH``, or a release with etcd-io/etcd#13766), or
None: ``./run_tests.sh`` installs Debian's where it runs as root."""
needs_etcd = pytest.mark.skipif(NO_ETCD is not None, reason=f"no etcd to start here: {NO_ETCD}")


def local_etcd(members: int = 3) -> etcd_local.LocalEtcd:
    """A started etcd cluster of ``members`` on loopback; the test is skipped, saying why, where there is none."""
    if NO_ETCD is not None:
        pytest.skip(f"no etcd to start here: {NO_ETCD}")
    return etcd_local.LocalEtcd(members).start()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The heaviest files first (``DURATIONS``; a stable sort keeps each file's tests in their order). A ``toml``
    test runs on TorchTitan 0.2 only; elsewhere it is skipped with its reason."""
    items.sort(key=lambda item: -DURATIONS.get(item.path.name, 0.0))
    if LINE == "0.2":
        return
    for item in items:
        if (mark := item.get_closest_marker("toml")) is not None:
            item.add_marker(pytest.mark.skip(reason=f"TorchTitan {LINE} has no TOML configs: {mark.args[0]}"))


@pytest.fixture(scope="session", autouse=True)
def run_secret() -> Iterator[str]:
    """The in-process tests play every role of one run: coordinator, launcher and ranks share its secret."""
    os.environ[keys.SECRET_ENV] = secret = secrets.token_hex(16)
    yield secret
    del os.environ[keys.SECRET_ENV]


def run_job(
    dump: Path, *overrides: str, timeout: int = 300, config: str = "llama3_debug_cpu", cut_lines: bool = False
) -> Run:
    """The shipped ``config`` at the tests' tiny size, as the installed TorchTitan line spells it. Its event
    log must be all JSON lines, unless ``cut_lines``: then a line a full disk cut short is left out."""
    cmd = [sys.executable, "-m", "titan_recover.launch", *job(dump, tiny=True, config=config), *overrides]
    env = {**{k: v for k, v in os.environ.items() if k != keys.SECRET_ENV}, "PYTHONUNBUFFERED": "1"}  # it makes one
    with tempfile.TemporaryDirectory() as said:
        out, err = Path(said, "stdout"), Path(said, "stderr")
        proc = forked_launcher.start(cmd, env, out, err)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        output = out.read_text() + err.read_text()
    path = dump / "recover_events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    events = [json.loads(line) for line in lines if not cut_lines or _whole(line)]
    return Run(proc.wait(), output, events)


def _whole(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def coordinator_command(job_argv: list[str]) -> list[str]:
    """``python -m titan_recover.coordinator`` as a launcher starts it for the job ``job_argv``: the job's
    settings as the record the launcher hands over."""
    from titan_recover import titan
    from titan_recover.config import CoordinatorSettings

    job_config = titan.load_config(job_argv)
    settings = CoordinatorSettings.of(job_config, titan.dump_folder(job_config))
    return [sys.executable, "-m", "titan_recover.coordinator", "--settings", settings.to_json()]


def assert_same_trajectory(reference: Run, run: Run, rel_tol: float, num_microbatches: int) -> None:
    """Every step once, M microbatches each, the reference's data digest, loss within rel_tol."""
    assert run.of("step") and all(len(e["microbatches"]) == num_microbatches for e in reference.of("step"))
    result = compare_runs(reference.events, run.events, rel_tol)
    assert not result.problems, result.problems
    assert result.steps == len(reference.of("step"))


def assert_all_rejoined(run: Run, replicas: int, last_step: int) -> None:
    """The run ends with every replica live and all of them holding the same parameters."""
    assert run.steps()[last_step]["members"] == list(range(replicas))
    digests = {e["replica"]: e["digest"] for e in run.of("param_digest") if e["step"] == last_step}
    assert sorted(digests) == list(range(replicas)), run.of("param_digest")
    assert len(set(digests.values())) == 1, digests
    assert not run.of("param_digest_mismatch")


THREE = [
    "--parallelism.data_parallel_replicate_degree",
    "3",
    "--parallelism.data_parallel_shard_degree",
    "1",
    "--training.global_batch_size",
    "12",
]  # M = 12 / 2 = 6, two each


SINGLES = [
    "--parallelism.data_parallel_shard_degree",
    "1",
    "--training.global_batch_size",
    "8",
    "--training.steps",
    "10",
]  # 2 single-rank replica groups, M = 8 / 2 = 4 as in the 2x2 job: for faults in the replicate dimension, the
# control plane or the data, where FSDP inside a group adds nothing to what is checked and each rank costs seconds


EXACT_EVERY_STEP = ["--recover.exact", "--recover.digest_interval", "1"]


def shared_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str, *overrides: str) -> Run:
    """A failure-free reference run made once per test session, not once per xdist worker:
    the first worker to ask runs it, the others wait on a file lock and read its result
    (pytest-xdist's documented pattern for session fixtures). Both CI cores train the tests'
    own runs instead of the same reference twice."""
    if worker_id == "master":  # no xdist: nothing to share (the base temp folder's parent outlives the session)
        return _passed(run_job(tmp_path_factory.mktemp(name), *overrides))
    cache = tmp_path_factory.getbasetemp().parent / f"{name}.json"  # one folder per session, seen by every worker
    with FileLock(f"{cache}.lock"):
        if not cache.exists():
            cache.write_text(json.dumps(asdict(run_job(tmp_path_factory.mktemp(name), *overrides))))
        return _passed(Run(**json.loads(cache.read_text())))


def _passed(run: Run) -> Run:
    """A reference ran without a failure: every step committed in the run's first epoch (one that broke its
    first all-reduce and retried in epoch 1 would still have the same trajectory)."""
    assert run.returncode == 0, run.output[-3000:]
    assert not run.of("failure") and {e["epoch"] for e in run.of("step")} == {0}, run.of("step")
    return run


@pytest.fixture(scope="session")
def three_replicas(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Run:
    """3 single-rank replica groups, no failure: the reference for the R=3 scenarios."""
    return shared_run(tmp_path_factory, worker_id, "three_replicas", *THREE, "--recover.fault_plan", "none")


@pytest.fixture(scope="session")
def two_singles(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Run:
    """2 single-rank replica groups for 10 steps (``SINGLES``), no failure: their reference trajectory."""
    return shared_run(tmp_path_factory, worker_id, "two_singles", *SINGLES, "--recover.fault_plan", "none")


@pytest.fixture(scope="session")
def exact_single(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Run:
    """One single-rank group in exact mode for ``SINGLES``' 10 steps (M = 4), a parameter digest every step:
    the bits every exact run of that job has, whatever its membership."""
    return shared_run(
        tmp_path_factory,
        worker_id,
        "exact_single",
        *SINGLES,
        *EXACT_EVERY_STEP,
        "--parallelism.data_parallel_replicate_degree",
        "1",
        "--recover.fault_plan",
        "none",
    )


@pytest.fixture(scope="session")
def failure_free(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Run:
    """titan_recover, 2 replica groups x 2 shards, no failure: the reference trajectory."""
    return shared_run(tmp_path_factory, worker_id, "failure_free", "--recover.fault_plan", "none")


def write_standin_tokenizer(folder: Path, vocab_size: int = 70_000) -> Path:
    """A word-level tokenizer with ``vocab_size`` entries (more than uint16 holds): words ``w<i>`` are id i.

    Stands in for Llama 3's 128,256-entry tokenizer, which needs a download.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
            }
        )
    )
    return folder


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def run_data_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m titan_recover.data ARGS`` in a real process."""
    return subprocess.run(
        [sys.executable, "-m", "titan_recover.data", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it, parents first (each thread's ``children`` in /proc)."""
    found, i = [pid], 0
    while i < len(found):
        for task in Path(f"/proc/{found[i]}/task").glob("*"):
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
        i += 1
    return found


def on_nodes(dump: Path, secret: str, *overrides: str) -> tuple[list[str], dict[str, str], str]:
    """The tests' tiny job for launchers standing for nodes on this host: the command (the first launcher runs
    the TCPStore coordinator on a free loopback port), the environment they share, and the coordinator's address
    the others name (``keys.COORDINATOR_ENV``)."""
    port = transport.free_port()
    args = [
        sys.executable,
        "-m",
        "titan_recover.launch",
        *job(dump, tiny=True),
        *overrides,
        "--recover.coordinator_port",
        str(port),
        "--recover.coordinator_bind",
        "127.0.0.1",
    ]
    return args, {**os.environ, keys.SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"}, f"127.0.0.1:{port}"


class Node:
    """One node's launcher, in a session of its own so that the whole node can be SIGKILLed."""

    def __init__(self, name: str, dump: Path, args: list[str], env: dict[str, str]) -> None:
        self.log = dump.parent / f"{name}.log"
        self.started = time.monotonic()
        self.proc = forked_launcher.start(args, env, self.log, new_session=True)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text()

    def kill_node(self) -> None:
        """SIGKILL of the launcher and its whole tree: torchrun agent and ranks."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def notice(self, every_process: bool = False) -> float:
        """A scheduler's notice that the node goes away: SIGTERM to the launcher (Kubernetes: the pod's
        first process), or to every process of the node (Slurm, systemd). When it was sent (monotonic)."""
        if every_process:
            os.killpg(self.proc.pid, signal.SIGTERM)
        else:
            self.proc.send_signal(signal.SIGTERM)
        return time.monotonic()

    def notice_tree(self) -> list[int]:
        """SIGTERM to every process of the launcher's tree, as Slurm signals every process of a job step: a
        ``killpg`` of the launcher's group misses the ranks, which torchrun starts in sessions of their own."""
        pids = descendants(self.proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        return pids

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.kill_node()


def events(dump: Path) -> list[dict]:
    """The run's events so far (a line still being written, after the last newline, is left for later)."""
    path = dump / "recover_events.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def fired(dump: Path, step: int) -> set[tuple[int, str]]:
    """The (replica, phase) of each fault the plan fired in ``step``: a hold that began shows its group is past
    that step's start, where a notice is heard (a fixed wait after the step before is not enough on a loaded CI)."""
    return {(e["replica"], e["phase"]) for e in events(dump) if e["event"] == "fault_injected" and e["step"] == step}


def unexplained_tracebacks(output: str, explained_by: str) -> list[str]:
    """Each traceback in ``output`` that does not end in ``explained_by`` (the one a test expects, such as
    torchrun's report of a rank its launcher killed), whole: a failing check shows what raised, not the log's tail."""
    return ["Traceback" + block[:4000] for block in output.split("Traceback")[1:] if explained_by not in block[:4000]]
