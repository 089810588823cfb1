"""The coordinator process: owns membership (live replica groups, epoch) and detection.

Started by the launcher, never a trainer. Its state lives in its own TCPStore;
the decisions come from ``membership`` (pure logic); this module only moves data
between the store, the detector and the event log. It fences failed groups,
admits restarted ones in a new epoch, and logs when a rejoined group's first
step commits.

    python -m titan_recover.coordinator --job.config_file X.toml [--section.key value ...]
    (serves on the port in $TITAN_RECOVER_COORDINATOR, the run whose secret is $TITAN_RECOVER_SECRET)
"""

import sys
import time

from titan_recover import config, store
from titan_recover.events import EventLog
from titan_recover.membership import (
    FailureDetector,
    Membership,
    TooFewReplicasError,
    admit,
    join_action,
    next_membership,
)

POLL_S = 0.02  # detection is bounded by report_confirm_s / heartbeats, not by this


def log(msg: str) -> None:
    print(f"[titan_recover coordinator] {msg}", flush=True)


class Coordinator:
    def __init__(self, job_config: object, port: int) -> None:
        rc = job_config.recover  # type: ignore[attr-defined]
        par = job_config.parallelism  # type: ignore[attr-defined]
        self.rc = rc
        self.steps = job_config.training.steps  # type: ignore[attr-defined]
        self.shards = config.group_ranks(par)  # ranks per replica group, each with a heartbeat
        self.replicas = par.data_parallel_replicate_degree
        self.store = store.serve(port, rc.collective_timeout_s, rc.coordinator_bind or store.LOOPBACK)
        self.events = EventLog(job_config.job.dump_folder)  # type: ignore[attr-defined]
        self.membership = Membership(0, tuple(range(par.data_parallel_replicate_degree)))
        self.detector = FailureDetector(
            members=self.membership.members,
            shards=self.shards,
            timeout_s=rc.heartbeat_timeout_s,
            confirm_s=rc.report_confirm_s,
            startup_s=rc.startup_timeout_s,
            start=time.monotonic(),
        )
        self.next_report = 1
        self.history: dict[int, Membership] = {}
        self.attempts = {r: 0 for r in self.membership.members}  # incarnation of each member
        self.admitted_epoch = {r: 0 for r in self.membership.members}
        self.joining: dict[int, int] = {}  # admitted, no step committed yet -> admission epoch
        self.down_since: dict[int, float] = {}  # failed replica -> when (for the rejoin downtime)
        self._publish(self.membership)

    def _publish(self, membership: Membership) -> None:
        # members/<e> is written before the epoch, so whoever sees an epoch can read its members
        store.put_json(self.store, store.members_key(membership.epoch), membership.to_json())
        self.store.set(store.EPOCH, str(membership.epoch))
        self.history[membership.epoch] = membership
        self.membership = membership

    def _progress(self) -> dict | None:
        """{"step", "epoch", "time"} of the last committed step, if any."""
        if not self.store.check([store.PROGRESS]):
            return None
        return store.get_json(self.store, store.PROGRESS, ("step", "epoch", "time"))

    def _step(self) -> int:
        """The step in progress: one past the last committed step."""
        progress = self._progress()
        return 1 if progress is None else int(progress["step"]) + 1

    def _poll_heartbeats(self, now: float) -> None:
        for replica in self.membership.members:
            for shard in range(self.shards):
                count = int(self.store.add(store.heartbeat_key(replica, shard), 0))
                if count:
                    self.detector.beat(replica, shard, count, now)

    def _poll_reports(self, now: float) -> None:
        count = int(self.store.add(store.REPORTS, 0))
        while self.next_report <= count:
            key = store.report_key(self.next_report)
            if not self.store.check([key]):
                return  # reserved but not yet written
            self.next_report += 1
            try:
                rec = store.get_json(self.store, key, ("epoch", "cause"))
            except store.MessageError as e:
                log(f"ignoring malformed report: {e}")
                continue
            suspect = rec.get("suspect")
            if suspect is None and rec["epoch"] < self.membership.epoch:
                continue  # about an epoch already replaced
            if suspect is not None and rec["epoch"] < self.admitted_epoch.get(suspect, 0):
                continue  # about an incarnation already replaced
            self.detector.report(suspect, str(rec["cause"]), now)

    def _failure_time(self, replica: int, default: float) -> float:
        """When an injected fault hit this incarnation (measurement only), else when it was detected."""
        key = store.fault_key(replica)
        if self.store.check([key]):
            try:
                rec = store.get_json(self.store, key, ("time", "attempt"))
                if rec["attempt"] == self.attempts[replica]:
                    return float(rec["time"])
            except (store.MessageError, TypeError, ValueError):
                pass
        return default

    def _fence(self, failed: dict[int, str]) -> bool:
        """Publishes the next epoch without ``failed``; False when too few replicas remain."""
        wall = time.time()
        step = self._step()
        first = wall
        for replica, cause in sorted(failed.items()):
            t = self._failure_time(replica, wall)
            first = min(first, t)
            self.down_since.setdefault(replica, t)
            self.events.emit("failure", replica=replica, step=step, cause=cause, time=t)
            log(f"replica {replica} failed at step {step}: {cause}")
        try:
            new = next_membership(self.membership, failed, self.rc.min_replicas, self.joining)
        except TooFewReplicasError as e:
            store.put_json(self.store, store.FATAL, {"error": str(e)})
            self.events.emit("fatal", step=step, error=str(e))
            log(f"FATAL: {e}")
            return False
        self._publish(new)
        for replica in failed:
            self.joining.pop(replica, None)
            # its launcher kills whatever is left of this incarnation (e.g. a hung rank)
            store.put_json(self.store, store.fenced_key(replica), {"attempt": self.attempts[replica], "epoch": new.epoch})
        self.detector.set_members(new.members)
        if failed:
            latency = time.time() - first
            self.events.emit("recovered", step=step, epoch=new.epoch, members=list(new.members), latency_s=latency)
            log(f"epoch {new.epoch}: members {list(new.members)} (recovered in {latency:.3f}s)")
        else:
            log(f"epoch {new.epoch}: retrying with the same members {list(new.members)}")
        return True

    def _poll_joins(self, now: float, progress: dict | None) -> bool:
        """Admits restarted groups whose ranks are all up; False when that is fatal."""
        if progress is not None and progress["step"] >= self.steps:
            return True  # the last step is done: nothing left to join
        for replica in range(self.replicas):
            key = store.join_key(replica)
            if not self.store.check([key]):
                continue
            try:
                attempt = store.get_json(self.store, key, ("attempt",))["attempt"]
                ready = int(self.store.add(store.join_ready_key(replica, attempt), 0))
            except (store.MessageError, TypeError, ValueError) as e:
                log(f"ignoring malformed join request of replica {replica}: {e}")
                continue
            action = join_action(self.membership.members, replica, self.attempts.get(replica, -1), attempt, ready, self.shards)
            if action == "wait":
                continue
            if action == "replace" and not self._fence({replica: f"restarted by its launcher (attempt {attempt})"}):
                return False
            new = admit(self.membership, replica)
            self._publish(new)
            self.attempts[replica] = attempt
            self.admitted_epoch[replica] = self.joining[replica] = new.epoch
            self.detector.set_members(new.members, now)
            store.put_json(self.store, store.admitted_key(replica), {"attempt": attempt, "epoch": new.epoch})
            self.events.emit("admitted", replica=replica, attempt=attempt, epoch=new.epoch, step=self._step())
            log(f"epoch {new.epoch}: replica {replica} (attempt {attempt}) admitted, members {list(new.members)}")
        return True

    def _poll_rejoined(self, progress: dict | None) -> None:
        """A joiner is back once a step commits in an epoch it is a member of."""
        if progress is None:
            return
        for replica, epoch in list(self.joining.items()):
            committed = self.history.get(progress["epoch"])
            if progress["epoch"] < epoch or committed is None or replica not in committed.members:
                continue
            del self.joining[replica]
            records = [self._transfer_record(replica, shard) for shard in range(self.shards)]
            downtime = progress["time"] - self.down_since.pop(replica, progress["time"])
            self.events.emit(
                "rejoined", replica=replica, step=progress["step"],
                bytes=sum(r.get("bytes", 0) for r in records),
                transfer_s=max(r.get("transfer_s", 0.0) for r in records),
                downtime_s=downtime,
            )
            log(f"replica {replica} rejoined at step {progress['step']}, {downtime:.1f}s after it failed")

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
            int(self.store.add(store.finished_key(r), 0)) >= self.shards
            for r in self.membership.members
            if r not in self.joining
        )

    def run(self) -> int:
        log(f"serving; members {list(self.membership.members)} x {self.shards} shards")
        while True:
            if self.store.check([store.FATAL]):  # a rank stopped the run (e.g. a DataError)
                error = store.get_json(self.store, store.FATAL, ("error",))["error"]
                self.events.emit("fatal", step=self._step(), error=error)
                log(f"FATAL: {error}")
                return 1
            now = time.monotonic()
            self._poll_heartbeats(now)
            self._poll_reports(now)
            failed, retry = self.detector.decide(now)
            if (failed or retry) and not self._fence(failed):
                return 1
            progress = self._progress()  # once per pass: both below read it
            if not self._poll_joins(now, progress):
                return 1
            self._poll_rejoined(progress)
            if self._finished():
                self.store.set(store.STATUS, "done")
                log("all live replica groups finished")
                return 0
            time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    address = store.coordinator_address()
    job_config = config.load(argv)
    port = int(address.rpartition(":")[2])
    coordinator = Coordinator(job_config, port)
    try:
        return coordinator.run()
    finally:
        time.sleep(1.0)  # let trainers read the final keys before the store goes away


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
