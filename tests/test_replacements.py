"""Replacement requests ([recover] replace): the pure decision (``policy.replacements``), the core's effects and
events around it, the launcher's record, and the sbatch command the Slurm plumbing builds (nothing submitted)."""

import json
import shlex
from pathlib import Path

import pytest

from titan_recover import config
from titan_recover.control import keys
from titan_recover.control.protocol import (
    CANCELLED,
    FAILED,
    JOINED,
    LEFT,
    CoordinatorState,
    MessageError,
    Replacing,
    Request,
)
from titan_recover.coordinator import slurm
from titan_recover.coordinator.core import Cancel, CoordinatorCore, Emit, Replace, Rules, Save, Say
from titan_recover.observability.summary import format_summary, summarize_events
from titan_recover.policy.membership import FailureDetector
from titan_recover.policy.replacements import TRIES, Bounds, Decision, decide

pytestmark = pytest.mark.unit

BOUNDS = Bounds(after_s=60.0, outstanding=2)


def test_a_group_out_past_the_bound_is_asked_for_and_one_out_less_long_is_not() -> None:
    assert decide(100.0, {1: 40.0, 2: 41.0}, [], False, BOUNDS) == Decision(request=((1,),))
    assert decide(100.0, {1: 40.1}, [], False, BOUNDS) == Decision()


def test_the_oldest_losses_are_asked_for_first_within_the_bound_on_open_requests() -> None:
    out = {5: 10.0, 3: 20.0, 4: 5.0}
    assert decide(100.0, out, [], False, BOUNDS).request == ((4,), (5,))
    open_ = [Request(1, (4,), 70.0, job="7")]
    assert decide(100.0, out, open_, False, BOUNDS).request == ((5,),)  # 4 is asked for already
    both = [*open_, Request(2, (5,), 70.0, job="8")]
    assert decide(100.0, out, both, False, BOUNDS) == Decision()  # two open: none more


def test_one_request_brings_a_node_of_as_many_groups_as_a_node_runs_and_a_remainder_waits() -> None:
    two = Bounds(after_s=60.0, outstanding=2, per_request=2)
    assert decide(100.0, {2: 1.0, 3: 1.0, 6: 2.0}, [], False, two).request == ((2, 3),)
    assert decide(100.0, {6: 2.0}, [], False, two) == Decision()  # a node asks for 2 free ids: 1 would turn it away


def test_a_request_whose_groups_are_all_back_is_cancelled_and_every_open_one_once_the_run_ended() -> None:
    requests = [
        Request(1, (1,), 70.0, job="7"),
        Request(2, (2,), 70.0),
        Request(3, (3,), 50.0, job="6", outcome=JOINED),
    ]
    assert decide(100.0, {2: 1.0}, requests, False, BOUNDS) == Decision(cancel=(1,))
    assert decide(100.0, {2: 1.0}, requests, True, BOUNDS) == Decision(cancel=(1, 2))  # a joined one is the run's


def test_a_joined_nodes_groups_are_not_asked_for_again_while_they_start_but_a_later_loss_is() -> None:
    joined = [Request(1, (1,), 70.0, job="7", outcome=JOINED, ended=90.0, took=(1,))]
    assert decide(100.0, {1: 10.0}, joined, False, BOUNDS) == Decision()  # admitted soon: the same loss
    assert decide(200.0, {1: 120.0}, joined, False, BOUNDS).request == ((1,),)  # lost again after it joined
    other = [Request(1, (1,), 70.0, job="7", outcome=JOINED, ended=90.0, took=(2,))]  # it took another free id
    assert decide(100.0, {1: 10.0, 2: 10.0}, other, False, BOUNDS).request == ((1,),)


def test_an_id_is_asked_for_again_only_a_bound_after_a_request_for_it_failed_and_at_most_tries_times() -> None:
    failed = [Request(1, (1,), 70.0, job="7", outcome=FAILED, ended=90.0)]
    assert decide(100.0, {1: 0.0}, failed, False, BOUNDS) == Decision()
    assert decide(150.0, {1: 0.0}, failed, False, BOUNDS).request == ((1,),)
    cancelled = [Request(1, (1,), 70.0, job="7", outcome=CANCELLED, ended=90.0)]  # the group was back: no count
    assert decide(100.0, {1: 0.0}, cancelled, False, BOUNDS).request == ((1,),)
    missed = [Request(n, (1,), 0.0, job=str(n), outcome=LEFT, ended=0.0) for n in range(1, TRIES + 1)]
    assert decide(1000.0, {1: 0.0}, missed, False, BOUNDS) == Decision()


def core(wall: list[float], per_request: int = 1) -> CoordinatorCore:
    rules = Rules(
        replicas=3, replica_ids=3, group_ranks=1, steps=100, min_replicas=1, max_step_retries=2, spare_timeout_s=5.0
    )
    detector = FailureDetector(members=(0, 1, 2), timeout_s=5.0, confirm_s=0.5, startup_s=60.0, start=0.0)
    bounds = Bounds(after_s=60.0, outstanding=2, per_request=per_request)
    return CoordinatorCore(rules, detector, wall=lambda: wall[0], replace_bounds=bounds)


def asked_for_replica_1(wall: list[float]) -> CoordinatorCore:
    """A core whose replica 1 was lost at wall 1000 and asked for at 1060, as Slurm's job 42."""
    c = core(wall)
    c.on_failure({1: "node lost"}, now=1.0)
    wall[0] = 1060.0
    c.on_replacements()
    c.on_submitted(1, "42", "sbatch")
    return c


def kinds(effects: list) -> list[str]:
    return [e.event for e in effects if isinstance(e, Emit)]


def test_the_core_asks_once_a_failed_group_is_out_past_the_bound_and_logs_the_job() -> None:
    wall = [1000.0]
    c = core(wall)
    c.on_failure({1: "node lost"}, now=1.0)
    assert c.on_replacements() == []
    wall[0] = 1060.0
    assert c.on_replacements() == [Save(), Replace(1, (1,))]
    assert c.on_replacements() == []  # open: not asked for twice
    effects = c.on_submitted(1, "42", "cd /repo && sbatch ...")
    [requested] = [e for e in effects if isinstance(e, Emit)]
    assert requested.event == "replacement_requested"
    assert requested.fields == {
        "request": 1,
        "job": "42",
        "replicas": [1],
        "out_s": [60.0],
        "command": "cd /repo && sbatch ...",
    }
    assert kinds(c.on_answered(1, (1,), "42")) == ["replacement_joined"]
    assert c.state.requests[0].outcome == JOINED
    wall[0] = 1200.0
    assert c.on_replacements() == []  # its group is starting: not asked for again
    assert c.on_replacements(ended=True) == []  # a joined node is the run's: nothing to cancel


def test_a_group_back_by_itself_cancels_the_open_request_even_one_still_being_submitted() -> None:
    wall = [1000.0]
    c = core(wall)
    c.on_failure({1: "node lost"}, now=1.0)
    wall[0] = 1061.0
    c.on_replacements()
    c.state.down_since.clear()  # admitted again: its own launcher restarted it
    assert c.on_replacements() == [Save()]  # the job is not known yet: cancelled once it is
    effects = c.on_submitted(1, "42", "sbatch ...")
    assert kinds(effects) == ["replacement_requested", "replacement_cancelled"]
    assert [e for e in effects if isinstance(e, Cancel)] == [Cancel(1, "42")]


def test_a_refused_submission_is_said_once_with_the_command_and_nothing_is_asked_again() -> None:
    wall = [1000.0]
    c = core(wall)
    c.on_failure({1: "node lost"}, now=1.0)
    c.on_failure({2: "node lost"}, now=1.0)
    wall[0] = 1060.0
    assert c.on_replacements() == [Save(), Replace(1, (1,)), Replace(2, (2,))]
    effects = c.on_submit_failed(1, "no sbatch on PATH here", "cd /repo && sbatch --nodes=1 x")
    [line] = [e for e in effects if isinstance(e, Say)]
    assert line.warn and line.message.endswith("To bring them back, run: cd /repo && sbatch --nodes=1 x")
    assert kinds(effects) == ["replacement_failed"]
    assert kinds(c.on_submit_failed(2, "no sbatch on PATH here", "...")) == ["replacement_failed"]
    wall[0] = 5000.0
    assert c.on_replacements() == []
    # a person ran the command: its node's record still names the request
    assert kinds(c.on_answered(1, (1,), "77")) == ["replacement_joined"] and c.state.requests[0].job == "77"
    assert c.on_replacements() == []  # and none is asked for again


def test_a_refused_request_still_cancels_the_open_ones_at_the_end() -> None:
    wall = [1000.0]
    c = asked_for_replica_1(wall)
    c.on_failure({2: "node lost"}, now=1.0)
    wall[0] = 1130.0
    assert c.on_replacements() == [Save(), Replace(2, (2,))]
    c.on_submit_failed(2, "sbatch exited 1: denied", "sbatch")
    assert [e for e in c.on_replacements(ended=True) if isinstance(e, Cancel)] == [Cancel(1, "42")]


def test_a_node_that_found_no_free_id_left_and_a_job_that_ended_silently_failed() -> None:
    wall = [1000.0]
    c = asked_for_replica_1(wall)
    assert kinds(c.on_answered(1, (), "42")) == ["replacement_left"]
    assert c.on_job_gone(1, "COMPLETED") == []  # ended as it said
    wall[0] = 1200.0
    assert c.on_replacements() == [Save(), Replace(2, (1,))]  # still out: asked again a bound later
    c.on_submitted(2, "43", "sbatch")
    assert kinds(c.on_job_gone(2, "FAILED")) == ["replacement_failed"]


def test_every_open_request_is_cancelled_when_the_run_ends() -> None:
    wall = [1000.0]
    c = asked_for_replica_1(wall)
    effects = c.on_replacements(ended=True)
    assert [e for e in effects if isinstance(e, Cancel)] == [Cancel(1, "42")]
    assert kinds(effects) == ["replacement_cancelled"]
    assert c.state.requests[0].outcome == CANCELLED and c.state.requests[0].why == "the run ended"


def test_a_new_leader_goes_on_with_the_requests_its_predecessor_saved() -> None:
    wall = [1000.0]
    old = asked_for_replica_1(wall)
    old.on_failure({2: "node lost"}, now=1.0)
    wall[0] = 1130.0
    assert old.on_replacements() == [Save(), Replace(2, (2,))]  # saved, then the leader died before sbatch answered
    raw = old.state.dumps().encode()
    new = core(wall)
    new.take_over(CoordinatorState.loads("state", raw), dict(old.history), max(old.history))
    submitted, lost = new.state.requests
    assert (submitted.job, submitted.outcome) == ("42", None)  # still open: cancelled when the run ends
    assert (lost.outcome, lost.why) == (FAILED, "its leader ended before the scheduler answered")
    assert new.on_replacements() == []  # two asked for already: not asked again at once
    assert kinds(new.on_answered(2, (2,), "43")) == ["replacement_joined"]  # its node came after all
    assert [e for e in new.on_replacements(ended=True) if isinstance(e, Cancel)] == [Cancel(1, "42")]
    refused = core(wall)
    refused.state.refused = True
    assert CoordinatorState.loads("state", refused.state.dumps().encode()).refused


@pytest.mark.parametrize(
    "request_json",
    [
        {"number": 2, "replicas": [1], "asked": 1.0},  # out of order
        {"number": 1, "replicas": [-1], "asked": 1.0},
        {"number": 1, "replicas": [1], "asked": 1.0, "outcome": "maybe"},
        {"number": 1, "replicas": [1], "asked": 1.0, "job": 42},
        {"number": 1, "replicas": [1], "asked": "soon"},
        "request 1",
    ],
)
def test_a_saved_request_is_checked_as_it_is_read(request_json: object) -> None:
    rec = {**CoordinatorState().to_json(), "requests": [request_json]}
    with pytest.raises(MessageError, match="request"):
        CoordinatorState.loads("state", json.dumps(rec).encode())


def test_the_launchers_record_round_trips_and_a_bad_one_is_refused() -> None:
    key = keys.replacement_key(3)
    assert Replacing.loads(key, Replacing((1, 2), "42").dumps().encode()) == Replacing((1, 2), "42")
    with pytest.raises(MessageError):
        Replacing.loads(key, b'{"replicas": [-1], "job": "42"}')


SLURM_ENV = {
    slurm.SCRIPT_ENV: "/repo/scripts/slurm/train.sbatch",
    slurm.ARGS_ENV: "train_configs/x.toml --recover.fault_plan sleep\\ replica=1\\;\\ x "
    "--parallelism.data_parallel_replicate_degree 2 --recover.spares 0",
    slurm.OPTIONS_ENV: "--output=/out/replacement-%j.out --partition=main",
    slurm.DIR_ENV: "/repo",
    slurm.JOIN_ENV: "node0:29510",
    keys.RUN_ENV: "7",
    keys.SECRET_FILE_ENV: "/out/secret",
    slurm.GROUPS_ENV: "1",
    "SLURM_JOB_ID": "7",
}


def test_the_submit_command_joins_the_run_by_its_secret_file_and_never_carries_the_secret() -> None:
    rc = config.Recover(enable=True)
    submitter, why = slurm.Submitter.of(rc, SLURM_ENV)
    assert submitter is not None and why == ""
    argv = submitter.command(2, ["node1"])
    assert argv[:6] == [
        "env",
        "JOIN_RUN=node0:29510",
        "TITAN_RECOVER_RUN_ID=7",
        "TITAN_RECOVER_SECRET_FILE=/out/secret",
        "GROUPS_PER_NODE=1",
        "TITAN_RECOVER_REPLACEMENT=2",
    ]
    assert argv[6:11] == ["sbatch", "--parsable", "--nodes=1", "--exclude=node1", "--export=ALL"]
    assert argv[11:14] == ["--output=/out/replacement-%j.out", "--partition=main", "/repo/scripts/slurm/train.sbatch"]
    assert argv[14:17] == ["train_configs/x.toml", "--recover.fault_plan", "sleep replica=1; x"]
    assert shlex.split(submitter.shown(argv).split(" && ", 1)[1]) == argv
    env = slurm.environment(
        {"PATH": "/bin", "SLURM_JOB_ID": "7", "SLURM_CONF": "/c", keys.SECRET_ENV: "s", "CONTROL_STORE": "nodes://a"}
    )
    assert env == {"PATH": "/bin", "SLURM_CONF": "/c"}


def test_on_etcd_a_replacement_joins_the_runs_control_store_as_its_launchers_rewrote_it() -> None:
    store = "etcd://n1:2379,n2:2379,n3:2379"
    env = {k: v for k, v in SLURM_ENV.items() if k != slurm.JOIN_ENV}  # train.sbatch sets it on the TCPStore only
    submitter, why = slurm.Submitter.of(config.Recover(enable=True, control_store=store), env)
    assert submitter is not None and why == ""
    assert submitter.command(1, [])[1] == f"JOIN_RUN={store}"  # in the environment: --export splits at commas
    submitter, why = slurm.Submitter.of(config.Recover(enable=True), env)
    assert submitter is None and slurm.JOIN_ENV in why


@pytest.mark.parametrize(
    "change, said",
    [
        ({"replace": "off"}, ""),
        ({"group_nodes": 2}, "one node per replica group"),
    ],
)
def test_no_submitter_where_replace_is_off_or_the_run_is_not_one_it_can_replace(change: dict, said: str) -> None:
    submitter, why = slurm.Submitter.of(config.Recover(enable=True, **change), SLURM_ENV)
    assert submitter is None and said in why and (said == "") == (why == "")


def test_no_submitter_outside_the_batch_scripts_job_and_it_says_what_is_missing() -> None:
    env = {k: v for k, v in SLURM_ENV.items() if k != slurm.SCRIPT_ENV}
    submitter, why = slurm.Submitter.of(config.Recover(enable=True), env)
    assert submitter is None and slurm.SCRIPT_ENV in why


def test_the_summary_names_each_request_and_what_became_of_it(tmp_path: Path) -> None:
    events = [
        {"event": "replacement_requested", "request": 1, "job": "42", "replicas": [1], "out_s": [60.0]},
        {"event": "replacement_joined", "request": 1, "job": "42", "replicas": [1]},
        {"event": "replacement_requested", "request": 2, "job": "43", "replicas": [2], "out_s": [61.0]},
        {"event": "replacement_cancelled", "request": 2, "job": "43", "replicas": [2], "reason": "the run ended"},
        {"event": "replacement_failed", "request": 3, "job": None, "replicas": [0], "error": "no sbatch on PATH here"},
    ]
    path = tmp_path / "recover_events.jsonl"
    path.write_text("".join(json.dumps({**e, "time": 1.0 + i}) + "\n" for i, e in enumerate(events)))
    text = format_summary(summarize_events(str(path)), tokens_per_step=1)
    assert "  replacement requests : 3\n" in text
    assert "    request 1 (job 42) for replica group(s) [1]: joined: replica group(s) [1]\n" in text
    assert "    request 2 (job 43) for replica group(s) [2]: cancelled: the run ended\n" in text
    assert "    request 3 for replica group(s) [0]: failed: no sbatch on PATH here\n" in text
