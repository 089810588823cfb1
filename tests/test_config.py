"""Tests for titan_recover.config: the [recover] section as TorchTitan loads it."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from launcher_in_process import launch_argv

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the package it was taken from, which titan_recover depends on
    import tomli as tomllib

from titan_recover import config, titan
from titan_recover.config import ConfigError, Recover, replica_ids

pytestmark = pytest.mark.toml(
    "these load the [recover] section from train_configs/*.toml (test_lines.py sets "
    "and checks its keys on 0.3's command line, test_bad_input.py its errors)"
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "llama3_debug_cpu.toml"


@pytest.fixture(autouse=True)
def _run_in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # the shipped TOML names ./titan_recover/assets and ./data relative to the repo root
    monkeypatch.chdir(ROOT)


def load(*overrides: str, config_file: Path = CONFIG):
    return titan.load_config(["--job.config_file", str(config_file), *overrides])


@pytest.mark.unit
def test_shipped_config_loads_and_validates() -> None:
    toml = tomllib.loads(CONFIG.read_text())
    jc = load()
    rc = jc.recover
    assert isinstance(rc, Recover)
    # every [recover] value of the TOML reaches the section
    for key, value in toml["recover"].items():
        assert getattr(rc, key) == value, key
    par, tr = toml["parallelism"], toml["training"]
    assert jc.parallelism.data_parallel_replicate_degree == par["data_parallel_replicate_degree"]
    assert jc.parallelism.data_parallel_shard_degree == par["data_parallel_shard_degree"]
    assert config.validate(jc) is rc
    assert config.num_microbatches(jc) == tr["global_batch_size"] // (
        tr["local_batch_size"] * par["data_parallel_shard_degree"]
    )


@pytest.mark.unit
def test_cli_overrides_reach_the_section() -> None:
    jc = load(
        "--recover.min_replicas",
        "2",
        "--recover.policy",
        "speed",
        "--recover.fault_plan",
        "none",
        "--training.global_batch_size",
        "32",
    )
    assert jc.recover.min_replicas == 2
    assert jc.recover.policy == "speed"
    assert jc.recover.fault_plan == "none"
    assert config.num_microbatches(jc) == 8


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, key",
    [
        (["--recover.min_replicas", "0"], "recover.min_replicas"),
        (["--recover.min_replicas", "3"], "recover.min_replicas"),
        (["--recover.heartbeat_timeout_s", "0.1"], "recover.heartbeat_timeout_s"),
        (["--recover.heartbeat_interval_s", "0"], "recover.heartbeat_interval_s"),
        (["--recover.report_confirm_s", "-1"], "recover.report_confirm_s"),
        (["--recover.notice_budget_s", "0"], "recover.notice_budget_s"),
        (["--recover.max_replicas", "1"], "recover.max_replicas"),
        (["--recover.max_replicas", "99"], "recover.max_replicas"),
        (["--recover.coordinator_port", "70000"], "recover.coordinator_port"),
        (["--recover.policy", "nosuch"], "recover.policy"),
        (["--recover.fault_plan", "explode replica=1 step=2"], "recover.fault_plan"),
        (["--recover.max_restarts", "-1"], "recover.max_restarts"),
        (["--recover.digest_interval", "0"], "recover.digest_interval"),
        (["--recover.digest_interval", "-5"], "recover.digest_interval"),
        (["--recover.fault_plan", "sleep replica=1 step=2"], "recover.fault_plan"),
        (["--recover.replicate_backend", "mpi"], "recover.replicate_backend"),
        (["--recover.warm", "true"], "recover.warm"),
        (["--recover.replace", "yes"], "recover.replace"),
        (["--recover.replace_after_s", "0"], "recover.replace_after_s"),
        (["--recover.max_replacements", "0"], "recover.max_replacements"),
        (["--parallelism.tensor_parallel_degree", "0"], "parallelism.tensor_parallel_degree"),
        (["--parallelism.pipeline_parallel_degree", "0"], "parallelism.pipeline_parallel_degree"),
        (["--parallelism.context_parallel_degree", "2"], "parallelism.context_parallel_degree"),
        (["--training.global_batch_size", "10"], "training.global_batch_size"),
        (["--training.global_batch_size", "0"], "training.global_batch_size"),
        (["--recover.restart_window_s", "0"], "recover.restart_window_s"),
        (["--recover.restart_window_s", "-60"], "recover.restart_window_s"),
        (["--recover.restart_window_s", "inf"], "recover.restart_window_s"),
        (["--recover.restart_window_s", "nan"], "recover.restart_window_s"),
    ],
)
def test_bad_value_names_the_full_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(*overrides)
    assert key in str(info.value)


@pytest.mark.unit
@pytest.mark.parametrize("degree", ["--parallelism.tensor_parallel_degree", "--parallelism.pipeline_parallel_degree"])
def test_exact_mode_with_tp_or_pp_names_the_keys(degree: str) -> None:
    with pytest.raises(ConfigError) as info:
        load("--recover.exact", degree, "2")
    msg = str(info.value)
    assert "recover.exact" in msg and "tensor_parallel_degree" in msg and "pipeline_parallel_degree" in msg
    load("--recover.exact")  # FSDP groups: accepted


@pytest.mark.unit
def test_rank_per_host_is_for_one_node() -> None:
    with pytest.raises(
        ConfigError, match="recover.nccl_rank_per_host is for one node .* recover.group_nodes = 2: unset it"
    ):
        load("--recover.nccl_rank_per_host", "--recover.group_nodes", "2")
    load("--recover.nccl_rank_per_host")


@pytest.mark.unit
def test_min_replicas_above_replicate_degree_names_both_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load("--recover.min_replicas", "3")
    msg = str(info.value)
    assert "recover.min_replicas (3)" in msg
    assert "parallelism.data_parallel_replicate_degree (2)" in msg


@pytest.mark.unit
def test_max_restarts_and_digest_interval_defaults() -> None:
    assert Recover().max_restarts == 3
    assert Recover().restart_window_s == 3600.0
    assert Recover().digest_interval == 10


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--recover.max_restarts", "-1"], "recover.max_restarts must be >= 0, got -1"),
        (["--recover.digest_interval", "0"], "recover.digest_interval must be >= 1, got 0"),
    ],
)
def test_restart_and_digest_bounds_messages(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(*overrides)
    assert message in str(info.value)


@pytest.mark.unit
def test_restart_and_digest_lowest_valid_values_load() -> None:
    rc = load("--recover.max_restarts", "0", "--recover.digest_interval", "1").recover
    assert (rc.max_restarts, rc.digest_interval) == (0, 1)
    rc = load("--recover.max_restarts", "7", "--recover.digest_interval", "25").recover
    assert (rc.max_restarts, rc.digest_interval) == (7, 25)


@pytest.mark.unit
def test_new_fault_actions_are_accepted_in_config() -> None:
    plan = "sleep replica=0 step=2 phase=optimizer seconds=0.5; stop replica=1 phase=donate; kill replica=1 phase=join"
    assert load("--recover.fault_plan", plan).recover.fault_plan == plan


@pytest.mark.unit
def test_timeout_must_exceed_twice_the_interval() -> None:
    with pytest.raises(ConfigError, match="heartbeat_interval_s"):
        load("--recover.heartbeat_timeout_s", "0.2")  # exactly twice 0.1
    assert load("--recover.heartbeat_timeout_s", "0.21").recover.heartbeat_timeout_s == 0.21


@pytest.mark.unit
def test_on_etcd_node_messages_are_at_least_0_4s_apart_and_the_timeout_must_allow_two() -> None:
    etcd = ("--recover.control_store", "etcd://h1:2379,h2:2379,h3:2379")
    assert config.node_message_interval_s(load(*etcd).recover) == 0.4
    assert config.node_message_interval_s(load().recover) == 0.1  # the TCPStore keeps heartbeat_interval_s
    slow = ("--recover.heartbeat_interval_s", "0.8", "--recover.report_confirm_s", "2")
    assert config.node_message_interval_s(load(*etcd, *slow).recover) == 0.8
    with pytest.raises(ConfigError, match=r"heartbeat_timeout_s must be more than 0.8s on etcd"):
        load(*etcd, "--recover.heartbeat_timeout_s", "0.8")


@pytest.mark.unit
@pytest.mark.parametrize(
    "store, confirm", [((), "0.2"), ((), "0.05"), (("--recover.control_store", "etcd://h1:2379"), "0.8")]
)
def test_report_confirm_must_exceed_twice_the_node_message_interval(store: tuple[str, ...], confirm: str) -> None:
    # a healthy replica's beat reaches the coordinator up to two node message intervals late:
    # a shorter confirmation fenced it after a report
    with pytest.raises(ConfigError) as info:
        load(*store, "--recover.report_confirm_s", confirm)
    twice = "0.8" if store else "0.2"
    assert f"recover.report_confirm_s must be more than {twice}s, twice the node message interval" in str(info.value)
    assert f"got {confirm}" in str(info.value)
    passing = f"{float(twice) + 0.01:g}"
    assert load(*store, "--recover.report_confirm_s", passing).recover.report_confirm_s == float(passing)


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--recover.fault_plan", "kill replica=1 step=31"],
            "recover.fault_plan: 'kill replica=1 step=31' can never fire: the run ends at training.steps = 30",
        ),
        (
            [
                "--training.steps",
                "6",
                "--recover.fault_plan",
                "kill replica=0 step=3; stop replica=1 phase=donate step=7",
            ],
            "'stop replica=1 step=7' can never fire: the run ends at training.steps = 6",
        ),
        (
            ["--recover.max_restarts", "0", "--recover.fault_plan", "kill replica=1 step=3 attempt=1"],
            "recover.fault_plan: 'kill replica=1 phase=backward attempt=1' can never fire: recover.max_restarts = 0 "
            "allows no restart, so only attempt 0 ever runs",
        ),
        (
            ["--recover.max_restarts", "0", "--recover.fault_plan", "kill replica=1 phase=join"],
            "'kill replica=1 phase=join attempt=1' can never fire: recover.max_restarts = 0",
        ),
        (
            ["--recover.spares", "1", "--recover.fault_plan", "kill replica=1 phase=join attempt=0"],
            "'kill replica=1 phase=join attempt=0' can never fire: replica 1 starts as a member and joins only once "
            "restarted (attempt >= 1); only a hot spare (replica 2..2) joins in its first incarnation",
        ),
        (
            ["--recover.spares", "1", "--recover.fault_plan", "kill replica=3 step=3"],
            "names no rank: the job has 3 replica groups (0..2, spares included)",
        ),
        (
            ["--recover.fault_plan", "flip replica=1 step=3"],
            "'flip replica=1' flips a microbatch's own gradient before it is summed, which only exact mode holds "
            "apart (elsewhere the backward adds it into the step's at once): set --recover.exact",
        ),
    ],
)
def test_fault_that_can_never_fire_is_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(*overrides)
    assert message in str(info.value)


@pytest.mark.unit
def test_a_flip_loads_in_exact_mode() -> None:
    plan = "flip replica=1 step=3 microbatch=0 bit=30; flip replica=0 rank=0 step=2 repeat=true"
    assert load("--recover.exact", "--recover.fault_plan", plan).recover.fault_plan == plan


@pytest.mark.unit
def test_fault_at_the_last_step_or_a_late_incarnation_loads() -> None:
    assert load("--recover.fault_plan", "kill replica=1 step=30").recover.fault_plan
    # restarts count per window: a long run may reach any incarnation, even past max_restarts
    assert load(
        "--recover.max_restarts", "1", "--recover.fault_plan", "kill replica=1 step=3 attempt=5"
    ).recover.fault_plan


@pytest.mark.unit
def test_bad_fault_plan_message_names_the_token() -> None:
    with pytest.raises(ConfigError, match="'explode'"):
        load("--recover.fault_plan", "explode replica=1 step=2")


@pytest.mark.unit
def test_an_experts_fault_needs_a_model_with_experts() -> None:
    rc = config.Recover(fault_plan="kill replica=1 step=2 phase=experts")
    config.check_experts_faults(rc, "an MoE flavor", has_experts=True)
    config.check_experts_faults(config.Recover(fault_plan="kill replica=1 step=2"), "a dense one", has_experts=False)
    with pytest.raises(ConfigError, match="phase=experts .* and a dense one has none"):
        config.check_experts_faults(rc, "a dense one", has_experts=False)


@pytest.mark.unit
def test_bad_policy_lists_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        load("--recover.policy", "nosuch")
    assert "'nosuch'" in str(info.value) and "balanced" in str(info.value)


def write_toml(tmp_path: Path, edit) -> Path:
    text = CONFIG.read_text()
    new = edit(text)
    assert new != text, "the edit did not change the shipped TOML"
    path = tmp_path / "job.toml"
    path.write_text(new)
    return path


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore:The field `recover")  # tyro notices the type, but only warns
def test_wrong_type_from_toml_names_the_key(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        lambda t: re.sub(r"(?m)^heartbeat_timeout_s = 5\.0$", 'heartbeat_timeout_s = "fast"', t),
    )
    with pytest.raises(ConfigError) as info:
        load(config_file=path)
    assert "recover.heartbeat_timeout_s" in str(info.value)
    assert "'fast'" in str(info.value)


@pytest.mark.unit
def test_int_where_float_expected_in_toml_is_fine(tmp_path: Path) -> None:
    path = write_toml(tmp_path, lambda t: re.sub(r"(?m)^heartbeat_timeout_s = 5\.0$", "heartbeat_timeout_s = 5", t))
    assert load(config_file=path).recover.heartbeat_timeout_s == 5


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore:The field `recover")
@pytest.mark.parametrize("bad", ["1.5", "true"])
def test_wrong_type_for_int_in_toml(tmp_path: Path, bad: str) -> None:
    path = write_toml(tmp_path, lambda t: re.sub(r"(?m)^min_replicas = 1$", f"min_replicas = {bad}", t))
    with pytest.raises(ConfigError, match=r"recover\.min_replicas must be of type int"):
        load(config_file=path)


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore:The field `recover")
@pytest.mark.parametrize(
    "key, bad", [("max_restarts", "2.5"), ("digest_interval", '"often"'), ("max_restarts", "true")]
)
def test_wrong_type_for_restart_and_digest_in_toml(tmp_path: Path, key: str, bad: str) -> None:
    def edit(text: str) -> str:  # replace the key's line, or add one if the TOML leaves it at its default
        text = re.sub(rf"(?m)^{key} = .*\n", "", text)
        return text.replace("[recover]\n", f"[recover]\n{key} = {bad}\n", 1)

    path = write_toml(tmp_path, edit)
    with pytest.raises(ConfigError, match=rf"recover\.{key} must be of type int"):
        load(config_file=path)


@pytest.mark.unit
def test_unknown_key_in_recover_section(tmp_path: Path) -> None:
    path = write_toml(tmp_path, lambda t: t + "\nheartbeat_timout_s = 3.0\n")
    with pytest.raises(ConfigError) as info:
        load(config_file=path)
    assert "heartbeat_timout_s" in str(info.value)


@pytest.mark.unit
@pytest.mark.parametrize("key", ["recover.heartbeat_timeout_s", "recover.report_confirm_s"])
def test_nan_durations_are_rejected(key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        load(f"--{key}", "nan")


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides",
    [
        ["--parallelism.data_parallel_shard_degree", "1"],  # the shipped plan kills rank 1: gone
        ["--recover.fault_plan", "stop replica=2 step=3"],
        ["--recover.fault_plan", "kill replica=0 step=3; sleep replica=1 rank=2 step=4 seconds=1"],
    ],
)
def test_fault_aimed_at_no_rank_is_refused(overrides: list[str]) -> None:
    with pytest.raises(
        ConfigError, match=r"recover.fault_plan: .* names no rank: the job has 2 replica groups \(0..1\)"
    ):
        load(*overrides)


@pytest.mark.unit
def test_fault_at_the_last_rank_of_the_last_group_loads() -> None:
    assert load("--recover.fault_plan", "kill replica=1 rank=1 step=3").recover.fault_plan


def test_launch_rejects_bad_config_with_exit_code_2(capfd: pytest.CaptureFixture[str]) -> None:
    proc = launch_argv(["--job.config_file", str(CONFIG), "--recover.min_replicas", "0"], capfd)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "recover.min_replicas" in proc.stderr
    # nothing was started: no coordinator or replica group printed anything
    assert "coordinator" not in proc.stdout
    assert "replica group" not in proc.stdout


def _par(pp: int, replicas: int, shards: int, tp: int) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(
        pipeline_parallel_degree=pp,
        data_parallel_replicate_degree=replicas,
        data_parallel_shard_degree=shards,
        tensor_parallel_degree=tp,
    )


@pytest.mark.unit
def test_group_coordinates_keep_each_ranks_pp_shard_tp_coordinate() -> None:
    # TorchTitan's world is (pp, dp_replicate, dp_shard, tp); a group's own is (pp, dp_shard, tp)
    pp, replicas, shards, tp = 2, 3, 2, 2
    par = _par(pp, replicas, shards, tp)
    seen = set()
    for rank in range(pp * replicas * shards * tp):
        p, rest = divmod(rank, replicas * shards * tp)
        r, rest = divmod(rest, shards * tp)
        s, t = divmod(rest, tp)
        assert config.group_coordinates(rank, par) == (r, (p * shards + s) * tp + t)
        seen.add(config.group_coordinates(rank, par))
    assert seen == {(r, k) for r in range(replicas) for k in range(config.group_ranks(par))}


@pytest.mark.unit
def test_one_rank_per_data_shard_reports_the_tally() -> None:
    par = _par(pp=2, replicas=1, shards=2, tp=2)  # group ranks: (stage, shard, tp)
    reporters = [k for k in range(config.group_ranks(par)) if config.reports_data(k, par)]
    assert reporters == [4, 6]  # last stage, tp rank 0, shards 0 and 1
    assert [config.reports_data(k, _par(1, 2, 2, 1)) for k in range(2)] == [True, True]  # plain HSDP


# --- parameter precision on a CPU (cpu_shim.precision_args) ---------------------------


@pytest.mark.unit
def test_a_cpu_run_gets_float32_parameters_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_recover.titan import cpu_shim

    monkeypatch.setattr(cpu_shim, "needed", lambda: True)
    argv = ["--job.config_file", str(CONFIG)]
    jc = titan.load_config(argv)
    assert jc.training.mixed_precision_param == "bfloat16"  # TorchTitan's default
    out = cpu_shim.precision_args(argv, jc, jc.job.config_file)
    assert out == [*argv, "--training.mixed_precision_param", "float32"]
    assert jc.training.mixed_precision_param == "float32"
    assert titan.load_config(out).training.mixed_precision_param == "float32"  # what ranks parse


@pytest.mark.unit
@pytest.mark.parametrize(
    "flag",
    [
        ["--training.mixed_precision_param", "bfloat16"],
        ["--training.mixed-precision-param", "bfloat16"],
        ["--training.mixed_precision_param=bfloat16"],
    ],
)
def test_a_precision_on_the_command_line_is_kept(monkeypatch: pytest.MonkeyPatch, flag: list[str]) -> None:
    from titan_recover.titan import cpu_shim

    monkeypatch.setattr(cpu_shim, "needed", lambda: True)
    argv = ["--job.config_file", str(CONFIG), *flag]
    jc = titan.load_config(argv)
    assert (
        cpu_shim.precision_args(argv, jc, jc.job.config_file) == argv
        and jc.training.mixed_precision_param == "bfloat16"
    )


@pytest.mark.unit
def test_a_precision_in_the_toml_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from titan_recover.titan import cpu_shim

    monkeypatch.setattr(cpu_shim, "needed", lambda: True)
    toml = tmp_path / "job.toml"
    toml.write_text(CONFIG.read_text().replace("[training]\n", '[training]\nmixed_precision_param = "bfloat16"\n'))
    argv = ["--job.config_file", str(toml)]
    jc = titan.load_config(argv)
    assert (
        cpu_shim.precision_args(argv, jc, jc.job.config_file) == argv
        and jc.training.mixed_precision_param == "bfloat16"
    )


@pytest.mark.unit
def test_an_accelerator_keeps_torchtitans_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_recover.titan import cpu_shim

    monkeypatch.setattr(cpu_shim, "needed", lambda: False)
    argv = ["--job.config_file", str(CONFIG)]
    jc = titan.load_config(argv)
    assert (
        cpu_shim.precision_args(argv, jc, jc.job.config_file) == argv
        and jc.training.mixed_precision_param == "bfloat16"
    )


@pytest.mark.unit
def test_spares_add_replica_ids_that_faults_may_name() -> None:
    job = load(
        "--recover.spares", "2", "--recover.fault_plan", "kill replica=3 phase=join attempt=0; kill replica=2 step=3"
    )
    assert replica_ids(job) == 4  # 2 members + 2 spares
    with pytest.raises(ConfigError, match="recover.spares must be >= 0, got -1"):
        load("--recover.spares", "-1")


@pytest.mark.unit
@pytest.mark.parametrize("key", ["speed_smoothing", "rebalance_threshold"])
@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_speed_keys_are_fractions(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"recover.{key} must be in \\(0, 1\\], got {value}"):
        load(f"--recover.{key}", value)


@pytest.mark.unit
def test_group_nodes_must_split_a_group_evenly() -> None:
    # the default config's groups have dp_shard 2 ranks: over 2 nodes one each, over 3 not evenly
    assert load("--recover.group_nodes", "2").recover.group_nodes == 2
    with pytest.raises(
        ConfigError, match=r"recover\.group_nodes \(3\) must divide the ranks of a replica group evenly"
    ):
        load("--recover.group_nodes", "3")
    with pytest.raises(ConfigError, match=r"recover\.group_nodes must be >= 1, got 0"):
        load("--recover.group_nodes", "0")


def header_commands(config_file: Path) -> dict[int, list[str]]:
    """The per-node commands in a config's header comments (``#   node i: ...``, ``\\`` continuing a line), as
    words."""
    commands: dict[int, str] = {}
    node = None
    for line in config_file.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if m := re.match(r"node (\d+): (.*)", text):
            node, text = int(m[1]), m[2]
            commands[node] = ""
        elif node is None or not commands[node].endswith("\\"):
            node = None
            continue
        commands[node] = commands[node].removesuffix("\\") + " " + text
    return {i: shlex.split(command) for i, command in commands.items()}


@pytest.mark.unit
@pytest.mark.parametrize("name", ["llama3_8b_hsdp_gpu", "llama3_8b_hsdp_tp_gpu"])
def test_the_8b_configs_manual_commands_pass_the_launchers_checks(name: str) -> None:
    """Each node's command in the 8B config's header, as the launcher reads it before anything starts: the job
    with the command's flags loads; node 0, which starts the coordinator, listens on an address the other node
    can reach (``launcher.coordinator_bind``) at the fixed port node 1 dials; every node has the run's secret
    (``launcher.choose_secret``), replica ids of its own that together are the run's, and an event log of its
    own. The header's Slurm command is the one tests/test_cluster_launch.py dry-runs."""
    from titan_recover.launch import launcher

    config_file = ROOT / "train_configs" / f"{name}.toml"
    commands = header_commands(config_file)
    assert sorted(commands) == [0, 1], commands
    envs, jobs = {}, {}
    for i, words in commands.items():
        run = words.index("./run_train.sh")
        env = dict(word.split("=", 1) for word in words[:run])
        assert env["CONFIG_FILE"] == f"train_configs/{name}.toml", env
        envs[i], jobs[i] = env, load(*words[run + 1 :], config_file=ROOT / env["CONFIG_FILE"])
    ids = replica_ids(jobs[0])
    local = {i: launcher.parse_replicas(env["TITAN_RECOVER_REPLICAS"], ids) for i, env in envs.items()}
    assert sorted(local[0] + local[1]) == list(range(ids)), local
    rc = jobs[0].recover
    assert "TITAN_RECOVER_COORDINATOR" not in envs[0]  # node 0's launcher starts the coordinator
    bind = launcher.coordinator_bind(rc.coordinator_bind, local[0], ids, rc.group_nodes)
    assert bind not in ("127.0.0.1", "0.0.0.0") and rc.coordinator_port > 0, (bind, rc.coordinator_port)
    assert envs[1]["TITAN_RECOVER_COORDINATOR"] == f"{bind}:{rc.coordinator_port}"
    for env in envs.values():
        assert launcher.choose_secret(env, only_this_node=False) == "$SECRET"  # the same on both nodes
    assert sorted(env["TITAN_RECOVER_NODE"] for env in envs.values()) == ["node0", "node1"]
    assert f"sbatch --nodes=2 --gpus-per-node=8 scripts/slurm/train.sbatch train_configs/{name}.toml" in (
        config_file.read_text()
    )
