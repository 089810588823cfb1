"""The coordinator process: owns membership (live replica groups, epoch) and detection.

Started by the launcher, never a trainer. Its state lives in the control store: its
own TCPStore, or etcd (``[recover] control_store``), where a candidate runs beside every
node's launcher, one leads (``leader``), and a new leader restores the state its
predecessor saved there (``COORDINATOR_STATE``, written with every epoch and every
logged step). The decisions come from ``membership`` (pure logic); this module only
moves data between the store, the detector and the event log. It fences failed groups,
admits restarted ones (or hot spares, which wait ready outside the membership) in a
new epoch while fewer than R groups are members, and logs when an admitted group's
first step commits.

    python -m titan_recover.coordinator --job.config_file X.toml [--section.key value ...]
    (serves on the port in $TITAN_RECOVER_COORDINATOR, the run whose secret is $TITAN_RECOVER_SECRET;
    with an etcd:// address there, campaigns to lead and leads until the run ends)
"""

import os
import socket
import sys
import time
from typing import Any, Callable

import torch.distributed as dist

from titan_recover import config, resources, store
from titan_recover.events import EventLog, logged_steps
from titan_recover.membership import (
    FailureDetector,
    GroupView,
    Membership,
    TooFewReplicasError,
    admit,
    group_views,
    job_error,
    join_action,
    next_membership,
    repaired_failure,
    retry_verdict,
)

POLL_S = 0.02  # detection is bounded by report_confirm_s / heartbeats, not by this
ETCD_POLL_S = 0.1  # on etcd each pass costs a few Raft-backed requests: 5x fewer passes (measured in bench.failover)
ALIVE_S = 0.25  # how often the alive counter moves (watchers allow coordinator_timeout_s)
REPORT_GRACE_S = 5.0  # a reserved report slot still empty after this: its reporter died in between
STEP_FIELDS = ("step", "epoch", "members", "microbatches", "data_digest", "loss", "time")


def log(msg: str) -> None:
    print(f"[titan_recover coordinator] {msg}", flush=True)


class LeaderEvents(EventLog):
    """The event log of a leader on etcd: each event is written only after the lease was
    confirmed, so a stale leader resuming from a freeze logs nothing (``LeadershipLost``)."""

    def __init__(self, dump_folder: str, confirm: Callable[[], None]) -> None:
        super().__init__(dump_folder)
        self._confirm = confirm

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        self._confirm()
        return super().emit(event, **fields)


def _ids(obj: Any, what: str, value: Callable[[Any], bool]) -> dict[int, Any]:
    """A saved ``{"<replica>": value}`` object with int keys, checked."""
    if not isinstance(obj, dict) or not all(isinstance(k, str) and k.isdigit() and value(v) for k, v in obj.items()):
        raise store.MessageError(f"store key {store.COORDINATOR_STATE!r}: {what} is not a map of replica ids: {obj!r:.200}")
    return {int(k): v for k, v in obj.items()}


def _is_time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_state(raw: dict[str, Any]) -> dict[str, Any]:
    """The state a leader saved, checked field by field (a new leader acts on it)."""
    progress = raw["progress"]
    if progress is not None and not (isinstance(progress, dict) and store.is_int(progress.get("step"))
                                     and store.is_int(progress.get("epoch")) and _is_time(progress.get("time"))):
        raise store.MessageError(f"store key {store.COORDINATOR_STATE!r}: progress needs step, epoch, time: {progress!r:.200}")
    if not (store.is_int(raw["next_report"]) and raw["next_report"] >= 1 and store.is_int(raw["retries"])):
        raise store.MessageError(f"store key {store.COORDINATOR_STATE!r}: next_report and retries must be integers")
    pair = lambda v: isinstance(v, list) and len(v) == 2 and store.is_int(v[0]) and _is_time(v[1])  # noqa: E731
    return {
        "progress": progress, "next_report": raw["next_report"], "retries": raw["retries"],
        **{k: _ids(raw[k], k, store.is_int) for k in ("attempts", "admitted_epoch", "joining", "spares", "dropped")},
        "down_since": _ids(raw["down_since"], "down_since", _is_time),
        "repairs": {r: tuple(v) for r, v in _ids(raw["repairs"], "repairs", pair).items()},
    }


STATE_FIELDS = ("progress", "next_report", "retries", "attempts", "admitted_epoch", "joining", "spares", "dropped",
                "down_since", "repairs")


class Coordinator:
    def __init__(self, job_config: object, client: dist.Store, events: EventLog, poll_s: float = POLL_S) -> None:
        rc = job_config.recover  # type: ignore[attr-defined]
        par = job_config.parallelism  # type: ignore[attr-defined]
        self.rc = rc
        self.steps = job_config.training.steps  # type: ignore[attr-defined]
        self.shards = config.group_ranks(par)  # ranks per replica group, each with a heartbeat
        self.replicas = par.data_parallel_replicate_degree  # members wanted; the rest of the ids are spares
        self.replica_ids = config.replica_ids(job_config)
        self.store = client
        self.events = events
        self.poll_s = poll_s
        self.membership = Membership(0, tuple(range(par.data_parallel_replicate_degree)))
        self.detector = FailureDetector(
            members=self.membership.members,
            timeout_s=rc.heartbeat_timeout_s,
            confirm_s=rc.report_confirm_s,
            startup_s=rc.startup_timeout_s,
            start=time.monotonic(),
        )
        self.next_report = 1
        self.empty_slots: dict[int, float] = {}  # reserved report slots not yet written -> first seen
        self.progress: dict | None = None  # {"step", "epoch", "time"} of the last committed step
        self.start_step: int | None = None  # the step the ranks started from (a DCP checkpoint's, or 0)
        self.retries = 0  # epochs retried with the same members in the step in progress
        self.reporters: set[int] = set()  # replicas that reported a broken collective in this step
        self.errors: dict[int, tuple[str, int]] = {}  # replica -> (its ranks' own error, step)
        self.history: dict[int, Membership] = {}
        self.attempts = {r: 0 for r in self.membership.members}  # incarnation of each member
        self.admitted_epoch = {r: 0 for r in self.membership.members}
        self.joining: dict[int, int] = {}  # admitted, no step committed yet -> admission epoch
        self.down_since: dict[int, float] = {}  # failed replica, not yet replaced -> when it failed
        self.repairs: dict[int, tuple[int, float]] = {}  # admitted group -> (failed replica it replaces, when)
        self.spares: dict[int, int] = {}  # groups ready to join while the membership is full -> attempt
        self.dropped: dict[int, int] = {}  # waiting incarnations fenced for silence -> attempt
        self.nodes: list[str] = []  # the launcher key of every registered node, in order
        self.pending_nodes: dict[int, float] = {}  # registrations not yet named -> first seen
        self.node_raw: dict[str, bytes] = {}  # each node's last message, and when it last changed
        self.node_groups: dict[str, tuple[dict[int, dict], float]] = {}
        self.views: dict[tuple[int, int], GroupView] = {}  # (replica, attempt) -> folded over its nodes
        self.asking: dict[int, int] = {}  # replica -> its latest incarnation whose ranks wait to join
        self.next_node_read = 0.0
        self.last_node_read: float | None = None  # when the node messages were last read
        self.next_alive = 0.0
        if self.store.check([store.COORDINATOR_STATE]):
            self._take_over()
        else:
            self._publish(self.membership)

    def _save(self) -> None:
        """Everything a new leader needs that the store does not hold otherwise."""
        state = {f: getattr(self, f) for f in STATE_FIELDS}
        state["repairs"] = {r: list(v) for r, v in self.repairs.items()}
        store.put_json(self.store, store.COORDINATOR_STATE, state)

    def _take_over(self) -> None:
        """Continues a run from the state its previous leader saved: the epochs from the store,
        the rest from the saved state; steps it saved but did not log yet are logged now.
        Every member gets one heartbeat timeout to show it is alive (its beats are read anew)."""
        state = read_state(store.get_json(self.store, store.COORDINATOR_STATE, STATE_FIELDS))
        for field, value in state.items():
            setattr(self, field, value)
        epoch = store.get_int(self.store, store.EPOCH)
        keys = [store.members_key(e) for e in range(epoch + 1)]
        for key, raw in zip(keys, self.store.multi_get(keys)):
            try:
                m = Membership.from_json(store.decode_json(key, raw, ("epoch", "members")))
            except ValueError as e:
                raise store.MessageError(f"store key {key!r}: {e}") from e
            self.history[m.epoch] = m
        self.membership = self.history[epoch]
        self.detector.set_members(self.membership.members)
        if self.progress is not None:  # past startup: every member beat before; the dead ones stop now
            self._grace(time.monotonic())
            if self.progress["step"] not in logged_steps(self.events.path):
                # saved, then its leader died before the event was written (saves precede events one step at a time)
                self.events.step(store.get_json(self.store, store.step_key(self.progress["step"]), STEP_FIELDS))
        log(f"took over at step {self._step()}: epoch {epoch}, members {list(self.membership.members)}")

    def _grace(self, now: float) -> None:
        """Every member and waiting spare counts as having beaten at ``now``: one heartbeat timeout
        to show it is alive, when the beats before could not be read."""
        for replica in (*self.membership.members, *self.spares):
            self.detector.expect(replica, now)

    def _publish(self, membership: Membership) -> None:
        # members/<e> is written before the epoch, so whoever sees an epoch can read its members
        store.put_json(self.store, store.members_key(membership.epoch), membership.to_json())
        self.store.set(store.EPOCH, str(membership.epoch))
        self.history[membership.epoch] = membership
        self.membership = membership
        self._save()

    def _step(self) -> int:
        """The step in progress: one past the last committed step (or the checkpoint resumed from)."""
        if self.progress is not None:
            return int(self.progress["step"]) + 1
        if self.start_step is None and self.store.check([store.START_STEP]):  # written once: read once
            try:
                self.start_step = store.get_int(self.store, store.START_STEP)
            except store.MessageError as e:
                log(f"ignoring malformed start step: {e}")
        return (self.start_step or 0) + 1

    def _poll_steps(self) -> None:
        """Logs each committed step once, in order, from the record its first committer wrote."""
        while self.store.check([key := store.step_key(self._step())]):
            try:
                rec = store.get_json(self.store, key, STEP_FIELDS)
                if rec["step"] != self._step() or not isinstance(rec["epoch"], int) or rec["epoch"] not in self.history:
                    raise store.MessageError(f"store key {key!r}: step record for another step or epoch: {rec!r:.200}")
            except store.MessageError as e:
                log(f"ignoring malformed step record: {e}")
                self.store.delete_key(key)  # a member rewrites it when it commits the step
                return
            self.progress = {k: rec[k] for k in ("step", "epoch", "time")}
            self.retries, self.reporters = 0, set()
            self._save()  # before the event: a leader that dies in between has its successor log it
            self.events.step(rec)
            for epoch in rec.get("data_epochs", []):
                log(f"data epoch {epoch} begins at step {rec['step']}: every sample of the corpus was read "
                    "once; they are read again in a new order")

    def _poll_nodes(self, now: float) -> None:
        """Reads every node's message in one request, once per heartbeat interval, and folds
        them per replica group: the only liveness the coordinator reads (its work grows with
        nodes, not ranks). Beats of the current incarnations reach the detector; a rank whose
        main loop is stuck is reported as its group's failure."""
        if now < self.next_node_read:
            return
        self.next_node_read = now + self.rc.heartbeat_interval_s
        if self.last_node_read is not None and now - self.last_node_read > self.rc.heartbeat_timeout_s / 2:
            self._grace(now)  # no lifeline could write, or none was read: silence says nothing about the groups
            log(f"no node message read for {now - self.last_node_read:.1f}s (the control store stalled, e.g. an etcd "
                "election, or this coordinator was frozen): every group gets one heartbeat timeout from now")
        count = int(self.store.add(store.NODES, 0))
        for index in range(len(self.nodes) + len(self.pending_nodes) + 1, count + 1):
            self.pending_nodes[index] = now
        for index, since in sorted(self.pending_nodes.items()):
            if self.store.check([store.node_key(index)]):  # written right after the counter
                del self.pending_nodes[index]
                self.nodes.append(store.launcher_key(self.store.get(store.node_key(index)).decode(errors="replace")))
            elif now - since > REPORT_GRACE_S:
                del self.pending_nodes[index]
                log(f"node {index} registered but never named its launcher (it died in between?); skipped")
        if not self.nodes:
            return
        for key, raw in zip(self.nodes, self.store.multi_get(self.nodes)):
            if raw == self.node_raw.get(key):
                continue  # its lifeline did not write since: its groups age
            self.node_raw[key] = raw
            try:
                self.node_groups[key] = (store.read_node_message(key, raw), now)
            except store.MessageError as e:
                log(f"ignoring malformed node message: {e}")
        self.last_node_read = now
        self.views = group_views(
            (replica, entry, seen) for groups, seen in self.node_groups.values() for replica, entry in groups.items()
        )
        self.asking = {replica: attempt for (replica, attempt), view in sorted(self.views.items()) if view.ready}
        for replica in (*self.membership.members, *self.spares):
            attempt = self.attempts.get(replica) if replica in self.membership.members else self.spares[replica]
            view = self.views.get((replica, attempt))  # type: ignore[arg-type]
            if view is None or view.ranks < self.shards:
                continue  # not every rank has beaten yet: the startup bound holds
            self.detector.beat(replica, view.alive_at)
            if view.stuck is not None:
                self.detector.report(replica, view.stuck, now)

    def _poll_reports(self, now: float) -> None:
        """Reads new reports; a reserved slot never written (its reporter died between
        reserving and writing) is skipped after ``REPORT_GRACE_S``, holding up no later report."""
        count = int(self.store.add(store.REPORTS, 0))
        for index in range(self.next_report, count + 1):
            self.empty_slots.setdefault(index, now)
        self.next_report = max(self.next_report, count + 1)
        for index, since in sorted(self.empty_slots.items()):
            key = store.report_key(index)
            if not self.store.check([key]):
                if now - since > REPORT_GRACE_S:
                    del self.empty_slots[index]
                    log(f"report slot {index} was reserved but never written (its reporter died?); skipped")
                continue
            del self.empty_slots[index]
            try:
                rec = store.read_report(self.store, key)
            except store.MessageError as e:
                log(f"ignoring malformed report: {e}")
                continue
            self._take_report(rec, now)

    def _take_report(self, rec: dict, now: float) -> None:
        suspect = rec.get("suspect")
        if suspect is None and rec["epoch"] < self.membership.epoch:
            return  # about an epoch already replaced
        if suspect is not None and rec["epoch"] < self.admitted_epoch.get(suspect, 0):
            return  # about an incarnation already replaced
        if rec.get("attempt") is not None and rec["attempt"] != self._incarnation(suspect):
            return  # a launcher's report about another incarnation (it crossed that group's restart)
        if suspect is None and rec.get("replica") is not None:
            self.reporters.add(rec["replica"])
        if suspect is not None and rec.get("error") and rec.get("step") is not None:
            self.errors[suspect] = (rec["error"], rec["step"])
        if suspect in self.spares:  # e.g. its launcher saw it exit while it waited
            self._drop_spare(suspect, rec["cause"])
        self.detector.report(suspect, rec["cause"], now)

    def _incarnation(self, replica: int | None) -> int | None:
        """The incarnation of ``replica`` the run holds now: as a member or as a waiting spare."""
        return self.spares[replica] if replica in self.spares else self.attempts.get(replica)  # type: ignore[arg-type]

    def _failure_time(self, replica: int, detected: float, now: float) -> tuple[float, str]:
        """When this incarnation failed, and by which clock: an injected fault's own time
        (measurement only), else the last heartbeat of its most silent rank (the failure
        came after it; found by a report or by silence alike), else the detection."""
        key = store.fault_key(replica)
        if self.store.check([key]):
            try:
                rec = store.get_json(self.store, key, ("time", "attempt"))
                if rec["attempt"] == self.attempts[replica]:
                    return float(rec["time"]), "fault_injected"
            except (store.MessageError, TypeError, ValueError):
                pass
        last = self.detector.silent_since(replica)  # a dead or hung rank beats no more; a live one just beat
        if last is not None:
            return detected - (now - last), "last_heartbeat"
        return detected, "detected"

    def _fence(self, failed: dict[int, str]) -> bool:
        """Publishes the next epoch without ``failed``; False when too few replicas remain."""
        wall, now = time.time(), time.monotonic()
        self._poll_steps()  # a step committed just before the failure belongs before it
        step = self._step()
        first = wall
        for replica, cause in sorted(failed.items()):
            t, clock = self._failure_time(replica, wall, now)
            first = min(first, t)
            if replica in self.repairs:  # failed before its first step: what it was to repair is open again
                replaced, since = self.repairs.pop(replica)
                self.down_since[replaced] = since
            else:
                self.down_since.setdefault(replica, t)
            self.events.emit("failure", replica=replica, step=step, cause=cause, time=t, clock=clock)
            log(f"replica {replica} failed at step {step}: {cause}")
        error = job_error(self.errors, self.membership.members)
        if error is not None:
            return self._stop(f"the job's own error, not a hardware failure: {error}; fix it and run again")
        try:
            new = next_membership(self.membership, failed, self.rc.min_replicas, self._still_joining())
        except TooFewReplicasError as e:
            return self._stop(str(e))
        self._publish(new)
        for replica in failed:
            self.joining.pop(replica, None)
            # its launcher kills whatever is left of this incarnation (e.g. a hung rank)
            store.put_json(self.store, store.fenced_key(replica), {"attempt": self.attempts[replica], "epoch": new.epoch})
        self.detector.set_members(new.members)
        if failed:
            latency = time.time() - first
            self.events.emit("recovered", step=step, epoch=new.epoch, members=list(new.members), latency_s=latency)
            self.events.emit("resources", process="coordinator", step=step, **resources.usage())
            log(f"epoch {new.epoch}: members {list(new.members)} (recovered in {latency:.3f}s)")
        else:
            log(f"epoch {new.epoch}: retrying step {step} with the same members {list(new.members)} "
                f"(retry {self.retries} of at most {self.rc.max_step_retries})")
        return True

    def _stop(self, error: str) -> bool:
        """Ends the run: every process sees ``fatal`` and stops; False for the caller to return."""
        store.put_json(self.store, store.FATAL, {"error": error})
        self.events.emit("fatal", step=self._step(), error=error)
        log(f"FATAL: {error}")
        return False

    def _still_joining(self) -> dict[int, int]:
        """Joiners without state. One admitted in an epoch whose step the store already
        marks committed holds that step's state, even if nobody has logged it yet."""
        decision = store.decision_key(self._step(), self.membership.epoch)
        if self.store.check([decision]) and self.store.get(decision) == b"commit":
            return {}  # every joiner was admitted in this epoch or before, so it took part in the commit
        return self.joining

    def _retry(self) -> bool:
        """The step's collectives broke with nobody silent: retry, fence who held it up, or stop."""
        self.retries += 1
        verdict, who = retry_verdict(self.membership.members, self.reporters, self.retries - 1, self.rc.max_step_retries)
        if verdict == "retry":
            return self._fence({})
        if verdict == "fence":
            reporters = sorted(self.reporters)
            return self._fence({r: f"step {self._step()} broke {self.retries} times: replicas {reporters} "
                                   "reported broken collectives and this one never did (it held them up)" for r in who})
        return self._stop(
            f"step {self._step()} broke {self.retries} times with every replica ({list(who)}) reporting broken "
            "collectives and none silent: check the network between the replica groups"
        )

    def _poll_joins(self, now: float) -> bool:
        """Admits groups whose ranks are all up while fewer than R are members (restarted ones,
        or hot spares waiting since the start); the others wait as spares. False when fatal."""
        progress = self.progress
        if progress is not None and progress["step"] >= self.steps:
            return True  # the last step is done: nothing left to join
        ready: dict[int, int] = {}
        for replica, attempt in self.asking.items():
            if replica >= self.replica_ids:
                log(f"ignoring a join request of replica {replica}: the run has ids 0..{self.replica_ids - 1}")
                continue
            up = self.views[(replica, attempt)].ready
            seen = max(self.attempts.get(replica, -1), self.dropped.get(replica, -1))
            action = join_action(self.membership.members, replica, seen, attempt, up, self.shards)
            if action == "replace":  # its previous incarnation is still a member: it takes its own place back
                if not self._fence({replica: f"restarted by its launcher (attempt {attempt})"}):
                    return False
                self._admit(replica, attempt, now)
            elif action == "admit":
                ready[replica] = attempt
        self.spares = {r: a for r, a in self.spares.items() if ready.get(r) == a}  # same incarnation, still waiting
        self._drop_silent_spares(now)
        ready = {r: a for r, a in ready.items() if a > self.dropped.get(r, -1)}
        free = max(0, self.replicas - len(self.membership.members))
        for replica in sorted(ready)[:free]:
            self.spares.pop(replica, None)
            self._admit(replica, ready[replica], now)
        for replica in sorted(ready)[free:]:
            if replica not in self.spares:
                self.spares[replica] = ready[replica]
                self.detector.expect(replica, now)  # its beats are watched from now on
                self.events.emit("spare_ready", replica=replica, attempt=ready[replica], step=self._step())
        return True

    def _drop_silent_spares(self, now: float) -> None:
        """A waiting group whose heartbeat stalled (hung while waiting) is fenced: its launcher
        kills it and starts it again, instead of it being admitted to hold the others up."""
        for replica in sorted(self.spares):
            last = self.detector.silent_since(replica)
            if last is not None and now - last >= self.rc.heartbeat_timeout_s:
                self._drop_spare(replica, f"heartbeat silent for {now - last:.2f}s while waiting as a spare")

    def _drop_spare(self, replica: int, cause: str) -> None:
        attempt = self.spares.pop(replica)
        self.dropped[replica] = attempt
        self._save()
        store.put_json(self.store, store.fenced_key(replica), {"attempt": attempt, "epoch": self.membership.epoch})
        self.events.emit("spare_lost", replica=replica, attempt=attempt, step=self._step(), cause=cause)
        log(f"spare replica {replica} (attempt {attempt}) fenced: {cause}")

    def _admit(self, replica: int, attempt: int, now: float) -> None:
        """Makes a ready group a member in a new epoch; it takes the state from a live peer."""
        new = admit(self.membership, replica)
        self._publish(new)
        self.attempts[replica] = attempt
        self.admitted_epoch[replica] = self.joining[replica] = new.epoch
        self.detector.set_members(new.members, now)
        replaced = repaired_failure(replica, self.down_since)
        if replaced is not None:
            self.repairs[replica] = (replaced, self.down_since.pop(replaced))
        store.put_json(self.store, store.admitted_key(replica, attempt), {"attempt": attempt, "epoch": new.epoch})
        instead = "" if replaced in (None, replica) else f" in place of replica {replaced}"
        self.events.emit("admitted", replica=replica, attempt=attempt, epoch=new.epoch, step=self._step(),
                         **({"replaces": replaced} if replaced is not None else {}))
        log(f"epoch {new.epoch}: replica {replica} (attempt {attempt}) admitted{instead}, members {list(new.members)}")

    def _poll_rejoined(self) -> None:
        """A joiner is back once a step commits in an epoch it is a member of."""
        progress = self.progress
        if progress is None:
            return
        for replica, epoch in list(self.joining.items()):
            committed = self.history.get(progress["epoch"])
            if progress["epoch"] < epoch or committed is None or replica not in committed.members:
                continue
            del self.joining[replica]
            records = [self._transfer_record(replica, shard) for shard in range(self.shards)]
            replaced, since = self.repairs.pop(replica, (replica, progress["time"]))
            downtime = progress["time"] - since
            self.events.emit(
                "rejoined", replica=replica, step=progress["step"],
                bytes=sum(r.get("bytes", 0) for r in records),
                transfer_s=max(r.get("transfer_s", 0.0) for r in records),
                downtime_s=downtime, **({"replaces": replaced} if replaced != replica else {}),
            )
            what = "rejoined" if replaced == replica else f"(a spare) replaced replica {replaced}"
            log(f"replica {replica} {what} at step {progress['step']}, {downtime:.1f}s after the failure")

    def _transfer_record(self, replica: int, shard: int) -> dict:
        key = store.transfer_key(replica, shard)
        if not self.store.check([key]):
            return {}
        try:
            return store.get_json(self.store, key, ("bytes", "transfer_s"))
        except store.MessageError as e:
            log(f"ignoring malformed transfer record: {e}")
            return {}

    def _finished(self) -> bool:
        """Every member with state has finished (a group still rejoining is not waited for)."""
        return all(
            (view := self.views.get((r, self.attempts[r]))) is not None and view.finished >= self.shards
            for r in self.membership.members
            if r not in self.joining
        )

    def end(self) -> None:
        """Wakes every node agent, blocked until the next epoch, to read the run's end (done or fatal)."""
        self._publish(Membership(self.membership.epoch + 1, self.membership.members))

    def run(self, confirm: Callable[[], None] = lambda: None) -> int:
        """Coordinates until the run ends; ``confirm`` raises once this leader lost its lease."""
        log(f"serving; members {list(self.membership.members)} x {self.shards} shards")
        while True:
            confirm()
            if time.monotonic() >= self.next_alive:
                self.store.add(store.ALIVE, 1)  # every process watches this move
                self.next_alive = time.monotonic() + ALIVE_S
            if self.store.check([store.FATAL]):  # a rank stopped the run (e.g. a DataError)
                self._poll_steps()  # steps committed before it belong before it
                try:
                    error = str(store.get_json(self.store, store.FATAL, ("error",))["error"])
                except store.MessageError as e:
                    error = f"a process stopped the run with a malformed message: {e}"
                self.events.emit("fatal", step=self._step(), error=error)
                log(f"FATAL: {error}")
                return 1
            now = time.monotonic()
            self._poll_steps()
            self._poll_nodes(now)
            self._poll_reports(now)
            failed, retry = self.detector.decide(now)
            if failed and not self._fence(failed):
                return 1
            if retry and not failed and not self._retry():
                return 1
            if not self._poll_joins(now):
                return 1
            self._poll_rejoined()
            if self._finished():
                self.store.set(store.STATUS, "done")
                log("all live replica groups finished")
                return 0
            time.sleep(self.poll_s)


def serve(job_config: object, port: int) -> Coordinator:
    """The coordinator on its own TCPStore, listening on ``port``."""
    rc = job_config.recover  # type: ignore[attr-defined]
    client = store.serve(port, rc.collective_timeout_s, rc.coordinator_bind or store.LOOPBACK)
    return Coordinator(job_config, client, EventLog(job_config.job.dump_folder))  # type: ignore[attr-defined]


def lead(job_config: object, address: str) -> int:
    """A candidate on etcd: campaigns, and once it leads, coordinates until the run ends; a
    leadership lost meanwhile (it froze past its lease) sends it back to campaigning."""
    from titan_recover.etcd_store import LeadershipLost
    from titan_recover.leader import Lease

    rc = job_config.recover  # type: ignore[attr-defined]
    secret = store.run_secret()
    raw = store.etcd(address, rc.coordinator_timeout_s)
    lease = Lease(raw, store.leader_key(secret), rc.leader_lease_s)
    view = store.in_run(raw, secret)

    def ended() -> bool:
        return view.check([store.STATUS]) or view.check([store.FATAL])

    while True:
        guarded = lease.campaign(ended)
        if guarded is None or ended():  # another candidate led the run to its end (perhaps as this one won)
            lease.resign()
            return 1 if view.check([store.FATAL]) else 0
        log(f"leading (lease {rc.leader_lease_s:g}s)")
        client = store.in_run(guarded, secret)
        try:
            events = LeaderEvents(job_config.job.dump_folder, guarded.confirm_guard)  # type: ignore[attr-defined]
            try:
                coordinator = Coordinator(job_config, client, events, ETCD_POLL_S)
            except store.MessageError as e:  # no leader could act on it: the run stops, saying why
                error = f"the coordinator state in etcd cannot be taken over: {e}; {config.resume_hint(job_config)}"
                store.put_json(client, store.FATAL, {"error": error})
                events.emit("fatal", error=error)
                log(f"FATAL: {error}")
                return 1
            events.emit("leader", pid=os.getpid(), host=socket.gethostname(), step=coordinator._step(),
                        epoch=coordinator.membership.epoch)
            code = coordinator.run(lease.check)
            coordinator.end()
            return code  # the state stays in etcd: no store to keep up for the others to read
        except LeadershipLost as e:
            log(f"no longer the leader ({e}); campaigning again")
        finally:
            lease.resign()


def main(argv: list[str]) -> int:
    address = store.coordinator_address()
    job_config = config.load(argv)
    if store.is_etcd(address):
        return lead(job_config, address)
    coordinator = serve(job_config, int(address.rpartition(":")[2]))
    try:
        code = coordinator.run()
        coordinator.end()
        return code
    finally:
        time.sleep(4 * store.PROBE_S)  # let every process read the final keys before the store goes away


if __name__ == "__main__":
    from titan_recover.launch import dumps_stacks

    dumps_stacks()
    sys.exit(main(sys.argv[1:]))
