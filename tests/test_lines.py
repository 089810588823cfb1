"""What the TorchTitan adapter must give on every TorchTitan line (``titan_recover.titan``): the
``recover`` section on the line's command line and tokens counted once. The kill, restart and rejoin
runs of the ``lines`` tier are in test_e2e.py and test_rejoin.py."""

from pathlib import Path
from typing import Any

import pytest
from conftest import Run

from titan_recover import titan
from titan_recover.config import ConfigError
from titan_recover.launch import preflight
from titan_recover.titan.jobs import LINE, job

pytestmark = pytest.mark.lines

M = 4  # global_batch_size 16 / (local_batch_size 2 * 2 shards)


def test_the_installed_line_is_the_adapters(tmp_path: Path) -> None:
    assert titan.LINE == LINE


def test_recover_keys_are_set_on_the_command_line_and_checked(tmp_path: Path) -> None:
    jc = titan.load_config([*job(tmp_path, tiny=True), "--recover.spares", "1", "--recover.policy", "speed"])
    assert (jc.recover.spares, jc.recover.policy, jc.recover.enable) == (1, "speed", True)
    assert titan.dump_folder(jc) == str(tmp_path) and titan.model_name(jc)[1] == "tiny"
    with pytest.raises(ConfigError, match="recover.heartbeat_timeout_s"):
        titan.load_config([*job(tmp_path, tiny=True), "--recover.heartbeat_timeout_s", "0"])


def test_the_comm_keys_and_their_defaults_are_read_for_the_preflight(tmp_path: Path) -> None:
    """The preflight checks TorchTitan's in-group timeout against the survivors' wait and its flight
    recorder against NCCL replicate groups, and changes either only where the job left it at TorchTitan's
    default: the adapter must read both values and defaults on every line."""
    default = preflight.comm_facts(titan.load_config(job(tmp_path, tiny=True)))
    assert default == {"train_timeout_seconds": (100.0, 100.0), "trace_buf_size": (20000.0, 20000.0)}
    flags = ["--comm.train_timeout_seconds", "300", "--comm.trace_buf_size", "0"]
    mine = preflight.comm_facts(titan.load_config([*job(tmp_path, tiny=True), *flags]))
    assert mine == {"train_timeout_seconds": (300.0, 100.0), "trace_buf_size": (0.0, 20000.0)}


def test_tokens_are_counted_once(failure_free: Run) -> None:
    """TorchTitan 0.3 counts ``ntokens_seen`` itself as each microbatch is prepared: counting it again
    in titan_recover would double it. Each rank computes M / 2 microbatches of 2 x 64 tokens a step."""
    seen = {(e["replica"], e["rank"]): e["ntokens_seen"] for e in failure_free.of("rank_memory")}
    assert len(seen) == 4 and set(seen.values()) == {6 * (M // 2) * 2 * 64}, seen


CONFIGS = Path(__file__).resolve().parents[1] / "train_configs"
PLUMBING = {("job", "description"), ("job", "custom_config_module"), ("experimental", "custom_import")}
"""TorchTitan 0.2's TOML plumbing, which a 0.3 recipe has no place for."""


def _recipe_value(config: Any, section: str, key: str) -> object:
    """Where TorchTitan 0.3 keeps what a 0.2 TOML calls ``[section] key`` (``config``: a 0.3 recipe's trainer
    config, which TorchTitan does not type)."""
    moved = {
        ("job", "dump_folder"): lambda: config.dump_folder,
        ("model", "name"): lambda: config.model_spec.name + "_recover",
        ("model", "flavor"): lambda: config.model_spec.flavor,
        ("model", "hf_assets_path"): lambda: config.hf_assets_path,
        ("optimizer", "name"): lambda: config.optimizer.param_groups[0].optimizer_name,
        ("optimizer", "lr"): lambda: config.optimizer.param_groups[0].optimizer_kwargs["lr"],
        ("optimizer", "eps"): lambda: config.optimizer.param_groups[0].optimizer_kwargs["eps"],
        ("training", "dataset"): lambda: config.dataloader.dataset,
        ("training", "dataset_path"): lambda: config.dataloader.dataset_path,
        ("activation_checkpoint", "mode"): lambda: {None: "none", "SelectiveAC": "selective", "FullAC": "full"}[
            config.activation_checkpoint and type(config.activation_checkpoint).__qualname__.split(".")[0]
        ],
        ("activation_checkpoint", "selective_ac_option"): lambda: "op",  # 0.3's selective AC is per-op only
    }
    return moved[section, key]() if (section, key) in moved else getattr(getattr(config, section), key)


@pytest.mark.skipif(LINE == "0.2", reason="the recipes are TorchTitan 0.3's configs; 0.2 reads the TOMLs themselves")
@pytest.mark.parametrize("toml", sorted(p.stem for p in CONFIGS.glob("*.toml")))
def test_each_recipe_equals_its_toml_twin(toml: str) -> None:
    """Model, data, parallelism, schedule, checkpoint and ``recover``: every key the TOML sets."""
    import tomli

    from titan_recover import recipes

    config = getattr(recipes, toml)()
    with open(CONFIGS / f"{toml}.toml", "rb") as f:
        sections = tomli.load(f)
    different = {
        f"{section}.{key}": (value, _recipe_value(config, section, key))
        for section, keys in sections.items()
        for key, value in keys.items()
        if (section, key) not in PLUMBING and _recipe_value(config, section, key) != value
    }
    assert not different, different  # key: (TOML, recipe)
    assert "flex" not in repr(config.model_spec.model).lower(), "attention must be SDPA, as on TorchTitan 0.2"


@pytest.mark.skipif(LINE == "0.2", reason="TorchTitan 0.2 has no CUDA graphs")
def test_a_fault_inside_a_cuda_graph_replay_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """On an NVIDIA GPU TorchTitan 0.3 replays forward and backward as a CUDA graph, which runs no Python
    hooks: a forward/backward fault could never fire, so the plan is refused unless graphs are off."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = ["--module", "titan_recover.recipes", "--config", "llama3_8b_hsdp_gpu", "--dump_folder", str(tmp_path)]
    kill = ["--recover.fault_plan", "kill replica=1 rank=1 step=5 phase=backward"]
    with pytest.raises(ConfigError, match="disable_cuda_graphs"):
        titan.load_config([*gpu, *kill])
    assert titan.load_config([*gpu, *kill, "--training.disable_cuda_graphs"]).recover.fault_plan == kill[1]
    assert titan.load_config([*gpu, "--recover.fault_plan", "kill replica=1 step=5 phase=allreduce"]).recover.fault_plan
