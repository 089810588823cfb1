"""``RecoverTrainer`` built and run in this process: one replica group of one rank commits one step.

The test plays the launcher and the coordinator by hand, as ``test_manager`` does for the manager alone:
the coordinator's store is a real TCPStore on loopback served from this process, epoch 0 (replica 0 alone)
is published into it and into a real node channel, and the environment is what torchrun and the launcher
give a rank. The rank builds TorchTitan's tiny llama3 (its default process group is a one-rank gloo world),
computes the step's microbatches, all-reduces over its one-member replicate group, votes, commits and
offers the step's record. The whole run through processes is test_e2e's.
"""

import gc
import math
import os
from pathlib import Path

import pytest
import torch.distributed as dist
from launcher_in_process import restored

from titan_recover.control import keys, transport
from titan_recover.control.client import COMMIT, ControlClient
from titan_recover.control.protocol import Membership
from titan_recover.control.sealed import Run
from titan_recover.data import prepare
from titan_recover.data.addressing import load_samples, model_vocab_size, piece_digest, sample_indices
from titan_recover.data.synthetic import TOKENIZER_DIR
from titan_recover.data.tokens import TokenDataset
from titan_recover.node.channel import CHANNEL_ENV, FINISHED, STATE, Channel
from titan_recover.observability.events import events_path, of_kind, read_events
from titan_recover.rank.manager import ReplicaFenced
from titan_recover.titan.jobs import FLAGS, job

LOOPBACK = "127.0.0.1"
M = 2  # global_batch_size 4 / local_batch_size 2 on one shard


def expected_digest(folder: Path, seq_len: int, seed: int, vocab_size: int) -> str:
    """Step 1's data digest from the addressing alone: the sum of the M pieces' digests, as the tally keeps it."""
    dataset = TokenDataset(str(folder))
    total = 0
    for m in range(M):
        samples = sample_indices(1, m, 0, num_microbatches=M, shards=1, local_batch=2)
        total += piece_digest(*load_samples(dataset, samples, seq_len=seq_len, seed=seed, vocab_size=vocab_size))
    return f"{total:016x}"


def test_one_rank_commits_one_step_in_this_process(tmp_path: Path, run_secret: str) -> None:
    from titan_recover import titan
    from titan_recover.rank.recover import RecoverTrainer
    from titan_recover.train import trainer

    data, dump = tmp_path / "data", tmp_path / "dump"
    prepare.prepare_synthetic(str(data), TOKENIZER_DIR, 20_000, 2, 0, workers=1, progress=False)
    jc = titan.load_config(
        [
            *job(dump, tiny=True),
            FLAGS["dataset_path"],
            str(data),
            FLAGS["assets"],
            TOKENIZER_DIR,
            "--training.steps",
            "1",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "4",
            "--parallelism.data_parallel_replicate_degree",
            "1",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--recover.fault_plan",
            "none",
            "--recover.coordinator_timeout_s",
            "3600",  # no launcher beats the channel here: the rank must not give its agent up for lost
            "--recover.collective_timeout_s",
            "10",  # a step that cannot commit fails the test in seconds
        ]
    )
    run = Run(run_secret, "trainer-test")
    server, port = transport.serve_any_port(LOOPBACK, 60.0, run)
    control = ControlClient(server)
    control.publish(Membership(0, (0,)))
    channel = Channel.create(0, 0, slots=1, directory=str(tmp_path))
    channel.publish(0, 0)
    collecting = gc.isenabled()
    with restored():  # the environment torchrun and the launcher give a rank; SIGTERM's handler (a notice here)
        os.environ.update(
            {
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": LOOPBACK,
                "MASTER_PORT": str(transport.free_port()),
                keys.REPLICA_ENV: "0",
                keys.INCARNATION_ENV: "0",
                keys.COORDINATOR_ENV: f"{LOOPBACK}:{port}",
                keys.RUN_ENV: run.id,
                CHANNEL_ENV: channel.path,
            }
        )
        os.environ.pop(keys.NOTICE_STOPS_RUN_ENV, None)
        rank = trainer(jc)
        try:
            assert isinstance(rank, RecoverTrainer)
            before = rank._param_digest()
            rank.train()
            after = rank._param_digest()
        finally:
            rank.close()
            if dist.is_initialized():
                dist.destroy_process_group()
            if collecting:
                gc.enable()  # TorchTitan's GC handler turned collection off for the process

    record = control.read_step(1)
    assert record is not None
    assert (record.step, record.epoch, record.members) == (1, 0, [0])
    assert record.microbatches == list(range(M))
    assert record.quotas == {"0": M}
    assert record.data_digest == expected_digest(data, jc.training.seq_len, jc.recover.data_seed, model_vocab_size(jc))
    assert record.loss is not None and record.grad_norm is not None
    # the step's mean token loss: an untrained model's guess is near uniform over its vocabulary
    assert abs(record.loss - math.log(model_vocab_size(jc))) < 1.0, record.loss
    assert math.isfinite(record.grad_norm) and record.grad_norm > 0
    assert record.seconds_per_microbatch.keys() == {"0"} and record.seconds_per_microbatch["0"] > 0
    assert control.start_step() == 0 and control.decision(1, 0) == COMMIT
    assert before != after  # the optimizer stepped with the reduced gradients
    events = read_events(events_path(str(dump)))
    assert [(e["step"], e["replica"], e["digest"]) for e in of_kind(events, "param_digest")] == [(1, 0, after)]
    assert control.digests(1, [0]) == {0: after}
    assert [(e["replica"], e["rank"]) for e in of_kind(events, "rank_memory")] == [(0, 0)]
    assert int(channel.read_slots()[0, STATE]) == FINISHED


@pytest.mark.unit
def test_a_rank_that_finds_its_group_fenced_ends_with_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ReplicaFenced ends the rank with exit 1 and one error line, no traceback: its launcher restarts the group."""
    from titan_recover import train

    def fenced(_: object) -> None:
        raise ReplicaFenced("replica 1 was fenced out in epoch 3")

    monkeypatch.setattr(train.titan, "run", fenced)
    with pytest.raises(SystemExit) as ended:
        train.main()
    assert ended.value.code == 1 and ended.value.__suppress_context__
    assert caplog.messages == [
        "replica 1 was fenced out in epoch 3: this rank ends, and its launcher restarts the group to rejoin"
    ]
