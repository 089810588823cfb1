"""The control plane's records: each message's one JSON form round-trips, and a malformed one is
refused with an error that names its key and field."""

import json
import re

import pytest

from titan_recover.config import ConfigError, CoordinatorSettings, Recover
from titan_recover.control.protocol import (
    MAX_SNAPSHOTS,
    Admission,
    CoordinatorState,
    Fatal,
    FaultRecord,
    Fence,
    Launcher,
    Loss,
    Membership,
    MessageError,
    NodeGroup,
    NodeMessage,
    Progress,
    Record,
    Rendezvous,
    Report,
    Snapshots,
    StepRecord,
    Stuck,
    TransferRecord,
    decode_int,
)

pytestmark = pytest.mark.unit

RECORDS: list[Record] = [
    Membership(3, (0, 2)),
    NodeMessage(3, {0: NodeGroup(1, 2, 2, 0, 0.25), 7: NodeGroup(0, 1, 0, 1, 1.5, Stuck(0, 9))}),
    NodeMessage(4, {0: NodeGroup(1, 2, 2, 0, 0.25)}, snapshot_bytes=146_800_640),
    NodeMessage(5, {}, snapshot_bytes=0),
    Report(epoch=2, cause="torchrun of replica 1 exited with code 1", replica=1, suspect=1, attempt=0, time=12.5),
    Report(epoch=0, cause="replicate all-reduce broke", replica=0, step=4, error="E"),
    Report(epoch=1, cause="replica 0 rank 0 waited 1s for the commit votes of step 4", replica=0, step=4, waiting=True),
    Report(epoch=3, cause="exited with code 1 (no restarts left)", replica=1, suspect=1, attempt=2, final=True),
    StepRecord(5, 2, [0, 1], [[0, 1], [2, 3]], "abc", 6.5, 0.9, 1000.0, [1], {"0": 2, "1": 2}, {"0": 0.1}, [[0, 64]]),
    Rendezvous(2, "10.0.0.5", 29600),
    Fence(1, 4),
    Admission(1, 5),
    Admission(2, 6, resume_step=4),
    Admission(2, 6, resume_step=0),
    Admission(2, 6, resume_step=4, holders={0: (1,), 1: (0, 2)}),
    Snapshots((8, 4)),
    Snapshots(()),
    Launcher("h:1:ab", "h", 1),
    TransferRecord(1024, 0.5, 10, 3),
    FaultRecord(1, 0, 0, 5, "backward", 99.0),
    Fatal("only 1 replica group(s) left"),
    CoordinatorState(
        Progress(4, 2, 1003.0), 7, 1, {0: 0, 1: 2}, {0: 0, 1: 5}, {1: 5}, {2: 0}, {3: 1}, {4: 900.0}, {1: (1, 950.5)}
    ),
    CoordinatorState(Progress(4, 6, 1003.0), attempts={0: 1}, loss=Loss(7, 990.5, (0, 1), resume_step=4)),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_its_json(record: Record) -> None:
    assert type(record).loads("k", record.dumps().encode()) == record


def test_fences_and_admissions_are_distinct_records() -> None:
    assert type(Fence.loads("fenced/1", Fence(1, 2).dumps().encode())) is Fence
    assert Fence(1, 2) != Admission(1, 2)


def test_an_admission_without_a_resume_step_writes_what_it_always_did() -> None:
    """A rejoiner that takes the state from a live peer: the record an older reader knows, read back the same."""
    assert json.loads(Admission(1, 5).dumps()) == {"attempt": 1, "epoch": 5}
    assert json.loads(Admission(1, 5, 3).dumps()) == {"attempt": 1, "epoch": 5, "resume_step": 3}
    assert Admission.loads("admitted/2/1", b'{"attempt": 1, "epoch": 5}').resume_step is None
    assert Admission.loads("admitted/2/1", b'{"attempt": 1, "epoch": 5, "resume_step": null}') == Admission(1, 5)


def test_a_snapshot_list_of_the_most_steps_is_read() -> None:
    steps = tuple(range(MAX_SNAPSHOTS, 0, -1))
    assert Snapshots.loads("snapshots/0/1/0", Snapshots(steps).dumps().encode()) == Snapshots(steps)
    with pytest.raises(MessageError, match=r"lacks fields \['steps'\]"):
        Snapshots.loads("snapshots/0/1/0", b"{}")


def test_a_node_message_without_snapshot_bytes_writes_and_reads_what_it_always_did() -> None:
    """Snapshots off, or a launcher that predates the field: no ``snapshot_bytes`` key, read back as None."""
    assert json.loads(NodeMessage(1, {}).dumps()) == {"seq": 1, "groups": {}}
    assert json.loads(NodeMessage(1, {}, 2048).dumps()) == {"seq": 1, "groups": {}, "snapshot_bytes": 2048}
    assert NodeMessage.loads("launcher/h:1:ab", b'{"seq": 1, "groups": {}}').snapshot_bytes is None
    assert NodeMessage.loads("launcher/h:1:ab", b'{"seq": 1, "groups": {}, "snapshot_bytes": null}') == NodeMessage(
        1, {}
    )


@pytest.mark.parametrize("bad", [-1, "1024", 1.5, True, [1], {"bytes": 1}])
def test_snapshot_bytes_that_are_not_a_count_are_refused(bad: object) -> None:
    with pytest.raises(MessageError, match="store key 'launcher/h:1:ab'.*snapshot_bytes must be an int >= 0"):
        NodeMessage.loads("launcher/h:1:ab", json.dumps({"seq": 1, "groups": {}, "snapshot_bytes": bad}).encode())


def test_a_launcher_record_is_canonical_json() -> None:
    """Claims compare the stored bytes: the same launcher always writes the same ones."""
    assert Launcher("x", "h", 1).dumps() == json.dumps({"host": "h", "launcher": "x", "pid": 1}, sort_keys=True)


@pytest.mark.parametrize(
    "kind, rec, words",
    [
        (NodeMessage, {"seq": "1", "groups": {}}, "seq must be an integer"),
        (NodeMessage, {"seq": 1, "groups": {"x": {}}}, "group 'x' is not a replica id"),
        (
            NodeMessage,
            {"seq": 1, "groups": {"0": {"attempt": 0, "ranks": -1, "ready": 0, "finished": 0, "silent_s": 0}}},
            "non-negative integers",
        ),
        (
            NodeMessage,
            {
                "seq": 1,
                "groups": {
                    "0": {"attempt": 0, "ranks": 1, "ready": 0, "finished": 0, "silent_s": 0, "stuck": {"rank": "0"}}
                },
            },
            "stuck needs integers",
        ),
        (Report, {"epoch": "0", "cause": "x"}, "epoch must be a non-negative integer"),
        (Report, {"epoch": 0, "cause": "x", "suspect": True}, "suspect must be a non-negative integer"),
        (Report, {"epoch": 0, "cause": ["x"]}, "cause and error must be strings"),
        (Report, {"epoch": 0, "cause": "x", "suspect": 1, "final": "yes"}, "final must be a boolean"),
        (Report, {"epoch": 0, "cause": "x", "final": True}, "said of a suspect"),
        (Report, {"epoch": 0, "cause": "x", "waiting": 1}, "waiting must be a boolean"),
        (Report, {"epoch": 0, "cause": "x", "waiting": True, "suspect": 1}, "a waiting report names no suspect"),
        (
            StepRecord,
            {"step": 1, "epoch": 0, "members": ["0"], "microbatches": [], "data_digest": "d", "loss": 1.0, "time": 0.0},
            "a step record needs",
        ),
        (Rendezvous, {"attempt": 2, "host": "10.0.0.5", "port": 0}, "port in 1..65535"),
        (Fence, {"attempt": -1, "epoch": 0}, "attempt and epoch must be integers >= 0"),
        (Launcher, {"launcher": "x", "host": "h", "pid": "1"}, "pid an integer"),
        (Admission, {"attempt": 1, "epoch": 2, "resume_step": -1}, "resume_step must be a step (int >= 0)"),
        (Admission, {"attempt": 1, "epoch": 2, "resume_step": "4"}, "resume_step must be a step (int >= 0)"),
        (Admission, {"attempt": 1, "epoch": 2, "resume_step": True}, "resume_step must be a step (int >= 0)"),
        (Admission, {"attempt": -1, "epoch": 2, "resume_step": 4}, "attempt and epoch must be integers >= 0"),
        (Admission, {"attempt": 1, "epoch": 2, "resume_step": 4, "holders": {"0": []}}, "holders must map shards"),
        (Admission, {"attempt": 1, "epoch": 2, "resume_step": 4, "holders": {"x": [1]}}, "holders must map shards"),
        (Admission, {"attempt": 1, "epoch": 2, "resume_step": 4, "holders": [[1]]}, "holders must map shards"),
        (Admission, {"attempt": 1, "epoch": 2, "holders": {"0": [1]}}, "only with a resume_step"),
        (Snapshots, {"steps": 4}, f"steps must be a list of at most {MAX_SNAPSHOTS} steps"),
        (Snapshots, {"steps": [4, "2"]}, f"steps must be a list of at most {MAX_SNAPSHOTS} steps"),
        (Snapshots, {"steps": [4, -2]}, f"steps must be a list of at most {MAX_SNAPSHOTS} steps"),
        (Snapshots, {"steps": list(range(MAX_SNAPSHOTS + 1))}, f"steps must be a list of at most {MAX_SNAPSHOTS}"),
        (
            CoordinatorState,
            {
                "progress": None,
                "next_report": 0,
                "retries": 0,
                "attempts": {},
                "admitted_epoch": {},
                "joining": {},
                "spares": {},
                "dropped": {},
                "down_since": {},
                "repairs": {},
            },
            "next_report and retries must be integers",
        ),
        (
            CoordinatorState,
            {
                "progress": None,
                "next_report": 1,
                "retries": 0,
                "attempts": {"a": 0},
                "admitted_epoch": {},
                "joining": {},
                "spares": {},
                "dropped": {},
                "down_since": {},
                "repairs": {},
            },
            "attempts is not a map of replica ids",
        ),
    ],
)
def test_a_malformed_record_is_refused_naming_its_key(kind: type[Record], rec: dict, words: str) -> None:
    with pytest.raises(MessageError, match="store key 'the/key'") as info:
        kind.loads("the/key", json.dumps(rec).encode())
    assert words in str(info.value)


def test_missing_fields_and_bytes_that_are_not_json_are_refused() -> None:
    with pytest.raises(MessageError, match=r"lacks fields \['cause'\]"):
        Report.loads("report/1", b'{"epoch": 0}')
    with pytest.raises(MessageError, match="does not hold JSON"):
        Report.loads("report/1", b"\x80\x04pickle")
    with pytest.raises(MessageError, match="must hold an integer"):
        decode_int("epoch", b"one")


SETTINGS = CoordinatorSettings(
    recover=Recover(enable=True, min_replicas=2),
    replicas=2,
    replica_ids=2,
    max_members=2,
    group_ranks=2,
    steps=6,
    tokens_per_step=512,
    precision="float32",
    dump_folder="/tmp/run",
    resume_hint="To resume, run the same command again",
    stop_hint="To resume, run the same command again: it resumes from the state saved at the stop",
)


def test_the_coordinators_settings_round_trip_through_json() -> None:
    settings = SETTINGS
    assert CoordinatorSettings.from_json(settings.to_json()) == settings


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "is not a settings record"),
        ("[1, 2]", "is not a settings record"),
        (SETTINGS.to_json().replace('"steps": 6, ', ""), "is not a settings record"),
        (
            SETTINGS.to_json().replace('"steps": 6', '"steps": "6"'),
            "coordinator --settings.steps must be of type int",
        ),
        (
            SETTINGS.to_json().replace('"min_replicas": 2', '"min_replicas": true'),
            "coordinator --settings.recover.min_replicas must be of type int",
        ),
    ],
    ids=["not-json", "not-an-object", "a-field-missing", "a-wrong-type", "a-wrong-type-in-recover"],
)
def test_a_malformed_settings_record_is_refused_naming_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        CoordinatorSettings.from_json(text)
