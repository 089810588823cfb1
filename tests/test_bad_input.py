"""Bad input a user can type: refused with exit 2 and a message naming the key (or variable, or file)
and what is allowed, before anything starts; never a traceback."""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path

import pytest
import torch
from conftest import run_data_cli
from launcher_in_process import data_cli, error_lines, launch, launch_process

from titan_recover import config, titan
from titan_recover.config import ConfigError, Recover, num_microbatches
from titan_recover.control import keys
from titan_recover.control.addresses import parse_etcd_url, parse_host_port
from titan_recover.data.synthetic import TOKENIZER_DIR
from titan_recover.launch.stores import check_coordinator
from titan_recover.titan.jobs import job

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "llama3_debug_cpu.toml"
DUMP = ROOT / "outputs" / "llama3_debug_cpu"  # the shipped job's own
MODEL_NAME = "model.name and experimental.custom_import are TOML settings (a 0.3 recipe picks its model in Python)"
UNRESOLVABLE = "nosuchhost.invalid"  # .invalid never resolves (RFC 6761)


@pytest.fixture(autouse=True)
def _run_in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the shipped TOML names its folders relative to the repo root


def load(*overrides: str):
    return titan.load_config([*job(DUMP), *overrides])


# ------------------------------------------------------------------ training sizes


@pytest.mark.unit
@pytest.mark.parametrize("key", ["local_batch_size", "global_batch_size", "seq_len", "steps"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_training_sizes_must_be_positive(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^training\.{key} must be an integer >= 1, got {value}$"):
        load(f"--training.{key}", value, "--recover.fault_plan", "none")


@pytest.mark.unit
def test_torchtitans_default_global_batch_means_one_microbatch_per_replica_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """TorchTitan's own configs (its llama3 debug_model.toml among them) leave ``global_batch_size`` at -1:
    ``local_batch_size`` times the data-parallel degree, no gradient accumulation."""
    with caplog.at_level(logging.INFO, logger="titan_recover.config"):
        jc = load("--training.global_batch_size", "-1", "--recover.fault_plan", "none")
    tr, par = jc.training, jc.parallelism
    replicas = par.data_parallel_replicate_degree
    assert tr.global_batch_size == tr.local_batch_size * par.data_parallel_shard_degree * replicas
    assert num_microbatches(jc) == replicas == 2
    assert f"M = {replicas} microbatches per step, one per replica group" in caplog.text


# ------------------------------------------------------------------ model.name


@pytest.mark.toml(MODEL_NAME)
def test_misspelled_model_name_lists_the_registered_ones() -> None:
    """In a real process: the data command line's own smoke test (its other refusals run in-process)."""
    r = run_data_cli("check", "--job.config_file", str(CONFIG), "--model.name", "llama33")
    assert r.returncode == 2, r.stderr[-3000:]
    assert (
        "error: model.name 'llama33' is not a registered model; registered by experimental.custom_import "
        "('titan_recover.train_spec'): deepseek_v3_recover, gpt_oss_recover, llama3_recover, llama4_recover, "
        "qwen3_recover; TorchTitan's own: deepseek_v3" in r.stderr
    )
    assert "Traceback" not in r.stderr


@pytest.mark.toml(MODEL_NAME)
def test_custom_import_that_does_not_import_names_the_key(capfd: pytest.CaptureFixture[str]) -> None:
    r = data_cli(capfd, "check", "--job.config_file", str(CONFIG), "--experimental.custom_import", "no_such_module_xyz")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "error: experimental.custom_import 'no_such_module_xyz' cannot be imported" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ addresses


@pytest.mark.unit
def test_coordinator_env_host_must_resolve() -> None:
    address = f"{UNRESOLVABLE}:29500"
    with pytest.raises(ConfigError) as info:
        check_coordinator(address)
    msg = str(info.value)
    assert msg.startswith(f"{keys.COORDINATOR_ENV}={address!r}: host {UNRESOLVABLE!r} does not resolve"), msg


@pytest.mark.unit
def test_host_names_parse_without_resolving() -> None:
    assert parse_host_port("node-3.cluster_a:1") == ("node-3.cluster_a", 1)  # resolved only where it is dialled


@pytest.mark.unit
@pytest.mark.parametrize("text", ["[::1]:29500", "[fe80::1]:1"])
def test_ipv6_literals_are_refused_at_parse_time(text: str) -> None:
    with pytest.raises(ValueError, match="IPv6 is not supported"):
        parse_host_port(text)
    with pytest.raises(ConfigError, match=rf"^{keys.COORDINATOR_ENV}='\[.*IPv6 is not supported"):
        check_coordinator(text)
    with pytest.raises(ValueError, match="IPv6 is not supported"):
        parse_etcd_url(f"etcd://{text},h2:2379,h3:2379")


@pytest.mark.unit
@pytest.mark.parametrize(
    "bind, problem",
    [
        ("::", "IPv6 is not supported"),
        ("[::1]", "IPv6 is not supported"),
        ("my host", "is not a host name or IPv4 address"),
        ("10.0.0.5:29500", "is not a host name or IPv4 address"),
    ],
)
def test_coordinator_bind_is_a_host(bind: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=rf"^recover\.coordinator_bind: .*{problem}"):
        load("--recover.coordinator_bind", bind)


@pytest.mark.unit
@pytest.mark.parametrize("bind", ["", "127.0.0.1", "0.0.0.0", "localhost"])
def test_coordinator_bind_this_host_can_listen_on(bind: str) -> None:
    config.check_coordinator_bind(Recover(coordinator_bind=bind))


@pytest.mark.unit
@pytest.mark.parametrize(
    "bind, problem",
    [
        (UNRESOLVABLE, f"host {UNRESOLVABLE!r} does not resolve"),
        ("192.0.2.1", "192.0.2.1 is not an address of this host"),
    ],
)  # TEST-NET-1
def test_coordinator_bind_this_host_cannot_listen_on(bind: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=rf"^recover\.coordinator_bind = {bind!r}: {problem}"):
        config.check_coordinator_bind(Recover(coordinator_bind=bind))


# ------------------------------------------------------------------ the launcher, as a user runs it


def test_launcher_process_refuses_a_bad_key() -> None:
    """In a real process, as a user runs it: the entry point exits 2 with one error line and no traceback
    (the other refusals run in-process, ``launcher_in_process``)."""
    proc = launch_process("--training.local_batch_size", "0")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert error_lines(proc.stderr) == ["error: training.local_batch_size must be an integer >= 1, got 0"], out[-3000:]
    assert "Traceback" not in out
    assert "coordinator at" not in out and "data:" not in out  # refused before the data check and any process


@pytest.mark.parametrize(
    "overrides, env, message",
    [
        pytest.param(
            ["--model.name", "llama33"],
            {},
            "error: model.name 'llama33' is not a registered model",
            marks=pytest.mark.toml(MODEL_NAME),
        ),
        (
            [],
            {keys.COORDINATOR_ENV: f"{UNRESOLVABLE}:29500", keys.SECRET_ENV: "s"},
            f"error: {keys.COORDINATOR_ENV}='{UNRESOLVABLE}:29500': host '{UNRESOLVABLE}' does not resolve",
        ),
        ([], {keys.COORDINATOR_ENV: "[::1]:29500", keys.SECRET_ENV: "s"}, "IPv6 is not supported"),
        (
            ["--recover.coordinator_bind", UNRESOLVABLE],
            {},
            f"error: recover.coordinator_bind = '{UNRESOLVABLE}': host '{UNRESOLVABLE}' does not resolve",
        ),
        (["--recover.status_port", "70000"], {}, "error: recover.status_port out of range: 70000"),
        (
            ["--recover.status_port", "8765", "--recover.status_bind", UNRESOLVABLE],
            {},
            f"error: recover.status_bind = '{UNRESOLVABLE}': host '{UNRESOLVABLE}' does not resolve",
        ),
    ],
    ids=[
        "model.name",
        "coordinator-host",
        "coordinator-ipv6",
        "coordinator_bind",
        "status_port",
        "status_bind",
    ],
)
def test_launcher_refuses_bad_input_before_starting(
    overrides: list[str], env: dict[str, str], message: str, capfd: pytest.CaptureFixture[str]
) -> None:
    proc = launch(capfd, *overrides, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert message in proc.stderr, out[-3000:]
    assert "Traceback" not in out
    assert "coordinator at" not in out and "data:" not in out  # refused before the data check and any process


@pytest.mark.parametrize("key, in_process", [("status_port", True), ("coordinator_port", False)])
def test_launcher_refuses_a_port_in_use_before_starting(
    key: str, in_process: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    """The status page's port is checked before the data; the coordinator's is bound by the first
    launcher itself (and handed to the coordinator), before any process starts. That one runs in a real
    process: the launcher gets furthest there (data checked, a socket bound) before refusing."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = (
            launch(capfd, f"--recover.{key}", str(port))
            if in_process
            else launch_process(f"--recover.{key}", str(port))
        )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"error: recover.{key} = {port}: cannot listen on 127.0.0.1:{port}" in proc.stderr, out[-3000:]
    assert "Address already in use" in proc.stderr
    assert "Traceback" not in out and "coordinator at" not in out
    assert key == "coordinator_port" or "data:" not in out


# ------------------------------------------------------------------ Megatron index


def _megatron_pair(folder: Path) -> Path:
    """One ``.bin``/``.idx`` pair written by Megatron's own builder; returns the ``.idx``."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    folder.mkdir()
    builder = IndexedDatasetBuilder(str(folder / "part_text_document.bin"), dtype=DType.optimal_dtype(2048))
    for n in (5, 9, 3):
        builder.add_document(torch.arange(n), lengths=[n])
    builder.finalize(str(folder / "part_text_document.idx"))
    return folder / "part_text_document.idx"


@pytest.mark.parametrize(
    "keep, problem", [(20, "end inside the header"), (40, "truncated: 40 bytes, but its 3 sequences")]
)
def test_truncated_megatron_index_names_the_file(
    tmp_path: Path, keep: int, problem: str, capfd: pytest.CaptureFixture[str]
) -> None:
    idx = _megatron_pair(tmp_path / "mg")
    os.truncate(idx, keep)
    r = data_cli(capfd, "index", str(idx.parent), "--tokenizer", TOKENIZER_DIR)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"error: {idx}: " in r.stderr and problem in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr


@pytest.mark.unit
def test_megatron_index_and_tokens_must_agree(tmp_path: Path) -> None:
    from titan_recover.data.tokens import DataError, index_folder

    idx = _megatron_pair(tmp_path / "mg")
    os.truncate(idx.with_suffix(".bin"), 2 * 10)  # 10 of its 17 uint16 tokens
    with pytest.raises(
        DataError, match=rf"^{re.escape(str(idx))}: its sequences hold 17 tokens, but .*\.bin holds 10:"
    ):
        index_folder(str(idx.parent), TOKENIZER_DIR, 2048)
