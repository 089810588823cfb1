"""Bad input from the node's environment or the tokenizer folder: a clear error (exit 2) before anything starts."""

from pathlib import Path

import pytest
from launcher_in_process import launch, launch_process

from titan_recover import titan
from titan_recover.config import ConfigError
from titan_recover.control import keys
from titan_recover.data.addressing import check_tokenizer_folder
from titan_recover.data.synthetic import TOKENIZER_DIR
from titan_recover.data.tokens import DataError
from titan_recover.launch.launcher import parse_any, parse_group_node, parse_replicas
from titan_recover.launch.stores import check_coordinator


@pytest.mark.unit
@pytest.mark.parametrize(
    "value, replicas, ids",
    [(None, 3, [0, 1, 2]), ("1", 2, [1]), ("2,0", 3, [2, 0]), (" 0, 1 ", 2, [0, 1])],
)
def test_replicas_env_lists_this_nodes_groups(value: str | None, replicas: int, ids: list[int]) -> None:
    assert parse_replicas(value, replicas) == ids


@pytest.mark.unit
@pytest.mark.parametrize(
    "value, problem",
    [
        ("1,x", "'x' is not a replica id"),
        ("", "an empty entry"),
        ("1,,0", "an empty entry"),
        ("0.5", "'0.5' is not a replica id"),
        ("1,1", "replica 1 is listed twice"),
        ("2", "replica 2 is out of range"),
        ("-1", "replica -1 is out of range"),
    ],
)
def test_bad_replicas_env_names_the_variable_and_value(value: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_replicas(value, 2)
    msg = str(info.value)
    assert msg.startswith(f"{keys.REPLICAS_ENV}={value!r}: {problem};"), msg
    assert "ids 0..1 (parallelism.data_parallel_replicate_degree + recover.spares, or recover.max_replicas = 2)" in msg


@pytest.mark.unit
def test_a_node_may_ask_for_any_free_replica_ids() -> None:
    assert parse_any(None, 4) is None and parse_any("0,1", 4) is None  # it names them
    assert parse_any("any", 4) == 1 and parse_any(" any:3 ", 4) == 3
    for bad in ("any:0", "any:5", "any:x", "anyway"):
        with pytest.raises(ConfigError, match=r"write any \(one free replica id\) or any:N, N from 1 to 4"):
            parse_any(bad, 4)


@pytest.mark.unit
@pytest.mark.parametrize("address", ["10.0.0.5:29500", "127.0.0.1:1", "localhost:65535"])  # hosts that resolve
def test_coordinator_env_host_port(address: str) -> None:
    assert check_coordinator(address) == address


@pytest.mark.unit
@pytest.mark.parametrize(
    "address, problem",
    [
        ("", "is not host:port"),
        ("localhost", "is not host:port"),
        (":29500", "is not host:port"),
        ("localhost:", "is not host:port"),
        ("localhost:http", "is not host:port"),
        ("local host:29500", "is not host:port"),
        ("localhost:-1", "is not host:port"),
        ("localhost:0", ": port 0 is out of range 1..65535"),
        ("localhost:65536", ": port 65536 is out of range 1..65535"),
    ],
)
def test_bad_coordinator_env_names_the_variable_and_value(address: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_coordinator(address)
    assert str(info.value).startswith(f"{keys.COORDINATOR_ENV}={address!r}{'' if problem[0] == ':' else ' '}{problem}")


@pytest.mark.unit
@pytest.mark.parametrize("value, parts, part", [(None, 1, 0), (None, 4, 0), ("0", 2, 0), ("3", 4, 3), (" 1", 2, 1)])
def test_group_node_env_says_which_part_of_its_groups_a_node_runs(value: str | None, parts: int, part: int) -> None:
    assert parse_group_node(value, parts) == part


@pytest.mark.unit
@pytest.mark.parametrize("value", ["2", "-1", "x", ""])
def test_bad_group_node_env_names_the_variable_and_the_range(value: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"{keys.GROUP_NODE_ENV}={value!r} is not a part of a replica group; set it to 0\.\.1"
    ):
        parse_group_node(value, 2)


@pytest.mark.unit
def test_tokenizer_folder_needs_tokenizer_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check_tokenizer_folder(TOKENIZER_DIR, "model.hf_assets_path")
    with pytest.raises(
        DataError, match=rf"^model.hf_assets_path: no tokenizer at {tmp_path} \(the folder has no tokenizer.json\)"
    ):
        check_tokenizer_folder(str(tmp_path), "model.hf_assets_path")
    monkeypatch.chdir(tmp_path)  # a relative path: say where it was looked for
    with pytest.raises(
        DataError, match=rf"no tokenizer at assets/tok \(no such folder, relative to the working directory {tmp_path}\)"
    ):
        check_tokenizer_folder("assets/tok", "model.hf_assets_path")


def test_launcher_process_refuses_a_bad_environment() -> None:
    """In a real process, as a user runs it: the entry point reads the node's environment (the other
    refusals run in-process, ``launcher_in_process``)."""
    proc = launch_process(env={keys.REPLICAS_ENV: "1,x"})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"error: {keys.REPLICAS_ENV}='1,x': 'x' is not a replica id" in proc.stderr
    assert "coordinator" not in proc.stdout and "data:" not in proc.stdout  # refused before the data check


@pytest.mark.parametrize(
    "env, message",
    [
        ({keys.COORDINATOR_ENV: "10.0.0.5:0"}, f"error: {keys.COORDINATOR_ENV}='10.0.0.5:0': port 0 is out of range"),
        (
            {keys.GROUP_NODE_ENV: "1"},
            f"error: {keys.GROUP_NODE_ENV}='1' is not a part of a replica group; set it to 0..0",
        ),
    ],
)
def test_launcher_refuses_a_bad_environment_before_starting(
    env: dict[str, str], message: str, capfd: pytest.CaptureFixture[str]
) -> None:
    proc = launch(capfd, env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr
    assert "coordinator" not in proc.stdout and "data:" not in proc.stdout  # refused before the data check


@pytest.mark.parametrize("folder", ["/nonexistent", "empty"])
def test_launcher_refuses_a_missing_tokenizer(folder: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    path = folder if folder.startswith("/") else str(tmp_path)  # an empty folder: TorchTitan's traceback, exit 1
    proc = launch(capfd, f"--{titan.ASSETS_KEY}", path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"error: {titan.ASSETS_KEY}: no tokenizer at {path} (" in proc.stderr
    assert "Traceback" not in proc.stderr and "coordinator" not in proc.stdout
