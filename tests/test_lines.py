"""What the TorchTitan adapter must give on every TorchTitan line (``titan_recover.titan``): the
``recover`` section on the line's command line and tokens counted once. The kill, restart and rejoin
runs of the ``lines`` tier are in test_e2e.py and test_rejoin.py."""

from pathlib import Path

import pytest

from bench.common import LINE, job
from conftest import Run
from titan_recover import titan
from titan_recover.config import ConfigError

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


def test_tokens_are_counted_once(failure_free: Run) -> None:
    """TorchTitan 0.3 counts ``ntokens_seen`` itself as each microbatch is prepared: counting it again
    in titan_recover would double it. Each rank computes M / 2 microbatches of 2 x 64 tokens a step."""
    seen = {(e["replica"], e["rank"]): e["ntokens_seen"] for e in failure_free.of("rank_memory")}
    assert len(seen) == 4 and set(seen.values()) == {6 * (M // 2) * 2 * 64}, seen

