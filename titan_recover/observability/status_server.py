"""The status page's server: ``/`` (the page), ``/status.json`` and ``/metrics`` (Prometheus).

The coordinator leader serves it when ``[recover] status_port`` is set (``serve_status``); so
does ``python -m titan_recover.status --events`` for a finished run. Whatever it shows comes
from the event log (``events.Tail``) and the control store (``StoreReader``), never from the
coordinator's memory, so a new leader on etcd serves the same run from where it took over.

One thread refreshes the snapshot, at most once a second and only while someone reads it;
requests are answered from the latest snapshot. The server takes GET only: nothing it serves
writes anything, and nothing secret is in it (the run is named by ``Run.public_id``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import MessageError, NodeMessage
from titan_recover.observability import host_memory
from titan_recover.observability.events import Tail
from titan_recover.observability.run_status import STATES, Live, LiveGroup, RunHistory

REFRESH_S = 1.0  # the snapshot is at most this old
IDLE_S = 30.0  # no refresh once nobody has read the page for this long
BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
log = logging.getLogger(__name__)


def page() -> bytes:
    return resources.files("titan_recover").joinpath("assets/status.html").read_bytes()


class StoreReader:
    """The control store now: the saved coordinator state and every node's message. Made and used
    by the refresh thread only (an etcd client belongs to its thread)."""

    def __init__(
        self, connect: Callable[[], ControlClient], messages: Callable[[ControlClient, list[str]], list[bytes]]
    ) -> None:
        self._connect, self._messages = connect, messages
        self._client: ControlClient | None = None
        self._names: dict[int, str] = {}  # registration index -> launcher key
        self._seen: dict[str, tuple[int, float]] = {}  # launcher key -> (seq, when first read)

    def forget_client(self) -> None:
        """After an error: the next read connects again (the store may have moved with its leader)."""
        self._client = None

    def read(self, now: float) -> Live:
        if self._client is None:
            self._client = self._connect()
        client = self._client
        state = client.read_state()
        for index in range(len(self._names) + 1, client.node_count() + 1):
            name = client.node_name(index)
            if name is None:
                break  # registered, not yet named: read again next time
            self._names[index] = name
        names = list(self._names.values())
        groups: dict[int, LiveGroup] = {}
        snapshot_bytes: dict[str, int] = {}
        for key, raw in zip(names, self._messages(client, names)):
            if not raw:
                continue
            try:
                message = NodeMessage.loads(key, raw)
            except MessageError as e:
                log.warning(f"status page: ignoring a malformed node message: {e}")
                continue
            seq, since = self._seen.get(key, (-1, now))
            if seq != message.seq:
                self._seen[key] = (message.seq, now)
                since = now
            host = key.split("/", 1)[-1].split(":", 1)[0]  # launcher/<host>:<pid>:<token>
            if message.snapshot_bytes is not None:
                snapshot_bytes[host_memory.node_of(key)] = message.snapshot_bytes
            for replica, entry in message.groups.items():
                age = entry.silent_s + (now - since)  # a launcher that stopped writing: its groups age
                old = groups.get(replica)
                if old is None or entry.attempt > old.incarnation:
                    groups[replica] = LiveGroup(entry.attempt, (host,), age)
                elif entry.attempt == old.incarnation:
                    groups[replica] = LiveGroup(
                        entry.attempt, tuple(sorted({*old.nodes, host})), max(age, old.heartbeat_age_s)
                    )
        saved = None if state is None else json.loads(state.dumps())  # as stored: replica ids as strings
        return Live(saved, groups, snapshot_bytes)


class StatusSource:
    """Keeps the snapshot: the history folded from the events so far, and the store now."""

    def __init__(
        self,
        tail: Tail,
        history: RunHistory,
        run_id: str | None = None,
        store: StoreReader | None = None,
        pending: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.tail, self.history, self.run_id, self.store = tail, history, run_id, store
        self.pending = pending  # what the coordinator's event log could not write yet (``EventLog.pending``)
        self.snapshot: dict[str, Any] | None = None
        self.store_error: str | None = None

    def refresh(self) -> dict[str, Any]:
        for event in self.tail.read():
            self.history.add(event)
        now = time.time()
        live = None
        if self.store is not None:
            try:
                live = self.store.read(now)
                self.store_error = None
            except Exception as e:  # a store that stalled or moved: the page still shows the events
                if self.store_error is None:
                    log.warning(
                        f"status page: the control store could not be read ({type(e).__name__}: {e}); "
                        "showing the event log only until it can"
                    )
                self.store_error = f"{type(e).__name__}: {e}"
                self.store.forget_client()
        snapshot = self.history.snapshot(self.run_id, now, live)
        snapshot["run"]["store_error"] = self.store_error
        snapshot["run"]["event_log"] = self.pending() if self.pending is not None else None
        self.snapshot = snapshot
        return snapshot


class Metrics:
    """``/metrics``: the latest snapshot in Prometheus's terms."""

    def __init__(self, source: StatusSource) -> None:
        self.source = source

    def collect(self) -> Any:
        s = self.source.snapshot
        if s is None:
            return
        run, groups = s["run"], s["groups"]
        yield GaugeMetricFamily("titan_recover_step", "The last committed step.", value=run["step"])
        if run.get("event_log"):
            for name, key, doc in (
                ("event_log_pending_events", "events", "Events the coordinator's event log waits to write."),
                ("event_log_dropped_events", "dropped", "Events dropped past the bound since the log failed."),
            ):
                yield GaugeMetricFamily(f"titan_recover_{name}", doc, value=run["event_log"][key])
        for name, key, doc in (
            ("steps_per_second", "steps_per_s", "Committed steps per second (latest steps)."),
            ("tokens_per_second", "tokens_per_s", "Tokens trained per second (latest steps)."),
        ):
            if run[key] is not None:
                yield GaugeMetricFamily(f"titan_recover_{name}", doc, value=run[key])
        step_times = [t for t in s["series"]["step_time_s"][-1:] if t is not None]
        if step_times:
            yield GaugeMetricFamily(
                "titan_recover_step_time_seconds", "Wall time of the last committed step.", value=step_times[0]
            )
        live = sum(g["state"] == "live" for g in groups)
        yield GaugeMetricFamily("titan_recover_live_groups", "Replica groups that are members and live.", value=live)
        by_state = GaugeMetricFamily("titan_recover_groups", "Replica groups in each state.", labels=["state"])
        for state in STATES:
            by_state.add_metric([state], sum(g["state"] == state for g in groups))
        yield by_state
        per_group = {
            "microbatches": GaugeMetricFamily(
                "titan_recover_group_microbatches",
                "Microbatches the group computed in the last step.",
                labels=["replica"],
            ),
            "incarnation": GaugeMetricFamily(
                "titan_recover_group_incarnation",
                "The group's newest incarnation (0, then +1 per restart).",
                labels=["replica"],
            ),
            "heartbeat_age_s": GaugeMetricFamily(
                "titan_recover_group_heartbeat_age_seconds",
                "Seconds since the group's most silent rank beat.",
                labels=["replica"],
            ),
        }
        for g in groups:
            for key, family in per_group.items():
                if g[key] is not None:
                    family.add_metric([str(g["replica"])], g[key])
        yield from per_group.values()
        per_node = {
            "bytes": GaugeMetricFamily(
                "titan_recover_snapshot_bytes",
                "Bytes of the node's host-memory snapshot folder, as its node message last said.",
                labels=["node"],
            ),
            "peak_bytes": GaugeMetricFamily(
                "titan_recover_snapshot_peak_bytes",
                "The run's peak of the node's host-memory snapshot folder.",
                labels=["node"],
            ),
        }
        for n in s.get("host_memory", []):
            for key, family in per_node.items():
                if n[key] is not None:
                    family.add_metric([n["node"]], n[key])
        yield from per_node.values()
        counts = s["counts"]
        yield CounterMetricFamily("titan_recover_failures", "Replica group failures.", value=counts["failures"])
        yield CounterMetricFamily(
            "titan_recover_leaves", "Replica groups that left on their node's notice.", value=counts["leaves"]
        )
        yield CounterMetricFamily(
            "titan_recover_rejoins", "Replica groups back with a live peer's state.", value=counts["rejoins"]
        )
        yield CounterMetricFamily(
            "titan_recover_param_digest_mismatches",
            "Parameter digests that differed across replicas.",
            value=counts["digest_mismatches"],
        )
        yield CounterMetricFamily(
            "titan_recover_sdc_checks",
            "Steps committed with an SDC check (recover.sdc_check).",
            value=counts["sdc_checks"],
        )
        yield CounterMetricFamily(
            "titan_recover_sdc_mismatches",
            "SDC checks whose groups' gradients of the checked microbatch differed.",
            value=counts["sdc_mismatches"],
        )
        yield GaugeMetricFamily(
            "titan_recover_quarantined_groups",
            "Replica groups quarantined: outvoted by SDC checks twice within the window, or on such a group's node.",
            value=counts["quarantined"],
        )
        for name, key, doc in (
            ("recovery_latency_seconds", "recovery_s", "From a failure to the survivors' new membership."),
            ("rejoin_downtime_seconds", "downtime_s", "From a failure to the group (or a spare) back with state."),
        ):
            values = s["latencies"][key]
            yield HistogramMetricFamily(f"titan_recover_{name}", doc, buckets=buckets(values), sum_value=sum(values))
        per_phase = HistogramMetricFamily(
            "titan_recover_recovery_phase_seconds",
            "From a fault to the end of each phase of its recovery (docs/observability.md#recovery-phases).",
            labels=["phase"],
        )
        for phase, values in s["latencies"]["phases"].items():
            per_phase.add_metric([phase], buckets(values), sum(values))
        yield per_phase


def buckets(values: list[float]) -> list[tuple[str, float]]:
    """Prometheus's cumulative buckets of ``values`` over ``BUCKETS_S``."""
    return [(str(b), float(sum(v <= b for v in values))) for b in BUCKETS_S] + [("+Inf", float(len(values)))]


class StatusServer:
    """Serves a ``StatusSource`` on ``(bind, port)`` from threads of its own until ``close``."""

    def __init__(self, source: StatusSource, bind: str, port: int) -> None:
        self.source = source
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(Metrics(source))  # a collector: collect() only
        self.read_at = 0.0  # when a client last asked
        self.fresh = threading.Event()  # set after each refresh
        self.wanted = threading.Event()
        self.closed = threading.Event()
        self.httpd = ThreadingHTTPServer((bind, port), self._handler())
        self.httpd.daemon_threads = True
        self.address = f"http://{bind}:{self.httpd.server_address[1]}/"
        self.threads = [
            threading.Thread(target=self.httpd.serve_forever, name="titan-recover-status", daemon=True),
            threading.Thread(target=self._refresh_loop, name="titan-recover-status-refresh", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _refresh_loop(self) -> None:
        while not self.closed.is_set():
            if not self.wanted.wait(timeout=REFRESH_S):
                continue
            start = time.monotonic()
            try:
                self.source.refresh()
            except Exception as e:  # a report: never the run's end
                log.warning(f"status page: refresh failed ({type(e).__name__}: {e})")
            self.fresh.set()
            if time.monotonic() - self.read_at > IDLE_S:
                self.wanted.clear()
            self.closed.wait(max(0.0, REFRESH_S - (time.monotonic() - start)))

    def current(self) -> dict[str, Any] | None:
        """The latest snapshot; the first request waits for one (a few seconds at most)."""
        self.read_at = time.monotonic()
        self.wanted.set()
        if self.source.snapshot is None:
            self.fresh.wait(timeout=5.0)
        return self.source.snapshot

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                path = self.path.split("?", 1)[0]
                if path in ("/", "/index.html"):
                    self._send(page(), "text/html; charset=utf-8")
                elif path == "/status.json":
                    snapshot = server.current()
                    if snapshot is None:
                        self.send_error(HTTPStatus.SERVICE_UNAVAILABLE, "no status yet")
                        return
                    self._send(json.dumps(snapshot).encode(), "application/json")
                elif path == "/metrics":
                    server.current()
                    self._send(generate_latest(server.registry), CONTENT_TYPE_LATEST)
                else:
                    self.send_error(HTTPStatus.NOT_FOUND, "the status server serves /, /status.json and /metrics")

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (http.server's name)
                log.debug(format % args)

        return Handler

    def close(self) -> None:
        """Stops serving and waits for a refresh under way: a thread left inside a store call
        while the interpreter exits could abort the process."""
        self.closed.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        for thread in self.threads:
            thread.join(timeout=5.0)
