"""titan_recover's trainer (``[recover] enable = true``): TorchTitan's Trainer with a fault-tolerant
replicate dimension.

Each torchrun job is one replica group (a TorchTitan world of dp_shard x tp x pp ranks; rank k of
every group holds the same coordinate, its ``group_rank``, and the replicate all-reduce joins those)
and ``train_step`` reads like TorchTitan's, with the protocol behind a ``manager.ReplicaManager``:

    epoch = manager.start_step(step) -> hand state to rejoiners -> assignment
    -> compute owned microbatches -> manager.allreduce -> manager.should_commit -> optimizer step

re-entering the loop in a new epoch when membership changes mid-step. With ``[recover] exact``
each microbatch's gradient goes onto a fixed-point sum (``exact.ExactSum``) right after its
backward, and a grid overflow redoes the step in the same epoch on the coarser grid all agreed on. A group the
launcher restarted (or a hot spare) first waits for the coordinator to admit it, then
receives parameters, optimizer, scheduler and step from a live peer (no checkpoint read).
With ``enable = false`` the rank runs ``stock.StockTrainer``, stock TorchTitan HSDP; both
modes log the same per-step events so their trajectories can be compared.
"""

import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import time
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_recover import titan
from titan_recover.config import is_spare, replica_ids, resume_hint, stop_folder, validate
from titan_recover.control import keys, transport
from titan_recover.control.addresses import route_address
from titan_recover.control.client import COMMIT, REDO
from titan_recover.control.protocol import MAX_SNAPSHOTS, Admission, MessageError, Snapshots, TransferRecord
from titan_recover.control.sealed import Run
from titan_recover.data import addressing
from titan_recover.node import procs
from titan_recover.observability import logs, resources
from titan_recover.policy import membership, sdc, steps, stop_budget, workload
from titan_recover.policy.fault_plan import Fault
from titan_recover.policy.membership import Membership, diverged
from titan_recover.rank import balancing, exact, snapshot, transfer
from titan_recover.rank.collectives import CollectiveAborted, ReplicateProcessGroups
from titan_recover.rank.manager import ReplicaFenced, ReplicaLeaving, ReplicaManager, RunDone, RunStopping
from titan_recover.rank.sdc_checks import Checks, CheckUndecided, ReplicaOutvoted, host_bytes
from titan_recover.rank.trainer import BaseTrainer

log = logging.getLogger(__name__)


class ReplicaDiverged(RuntimeError):
    """This replica's parameters differ from the others': it reported itself and restarts."""


THIRD, RECOMPUTE, NEXT_EPOCH = "third opinion", "computed again", "outvoted"  # what a check's mismatch leads to


class RecoverTrainer(BaseTrainer):
    """TorchTitan's Trainer for one replica group; the replicate dimension is titan_recover's.

    State transfer to a rejoiner stays here: what the state is (model parts, optimizers,
    schedulers, step counters, measured speeds) and where the plan's join/donate faults
    fire are the trainer's; the manager supplies the protocol around it (the two-rank
    group that aborts when the epoch moves, the reports, the transfer record).
    """

    def __init__(self, job_config: titan.JobConfig) -> None:
        rc = validate(job_config)
        if rc.exact:
            exact.pin_kernels()
        replica, group_rank = int(os.environ[keys.REPLICA_ENV]), int(os.environ["RANK"])
        self.log = logs.for_rank(log, replica, group_rank)  # its lines begin with replica and rank
        # each group is a torchrun world of its own: rank k of every group would write the same profiler
        # and flight-recorder (NCCL timeout) trace files
        for section in (titan.profiler(job_config), job_config.comm):
            section.save_traces_folder = os.path.join(section.save_traces_folder, f"replica{replica}")
        # a restarted group, or a hot spare, holds no state until a peer sends it
        rejoining = keys.incarnation() > 0 or is_spare(replica, job_config)
        self.manager = ReplicaManager.connect(  # before TorchTitan builds the model: its lifeline beats meanwhile
            rc,
            replica=replica,
            group_rank=group_rank,
            incarnation=keys.incarnation(),
            rejoining=rejoining,
            resume_hint=resume_hint(job_config, titan.dump_folder(job_config)),
        )
        # SIGTERM to every process of the node: leave, do not die; where the coordinator runs, it stops the whole
        # run at one step boundary instead, which this group's own leave would forestall
        self._run_noticed_at: float | None = None  # there: when this process was told (the save's time left)
        procs.on_notice(self._note_run_notice if os.environ.get(keys.NOTICE_STOPS_RUN_ENV) else self.manager.notice)
        metrics = job_config.metrics
        wanted = metrics.enable_tensorboard, metrics.enable_wandb
        metrics.enable_tensorboard = metrics.enable_wandb = False  # TorchTitan's own write to a folder per start time
        try:
            super().__init__(job_config, rc, replica, group_rank)
        finally:
            metrics.enable_tensorboard, metrics.enable_wandb = wanted
        self.logs_recovery = any(wanted)
        if self.logs_recovery:  # one folder per group, every incarnation's in it: one TensorBoard run per group
            name_wandb_run(replica)
            folder = os.path.join(titan.dump_folder(job_config), metrics.save_tb_folder, f"replica{replica}")
            self.metrics_processor.logger = titan.metric_logger(job_config, self.parallel_dims, folder)
        self.replicate_groups = ReplicateProcessGroups(
            self.manager.store,
            replica,
            group_rank,
            rc.collective_timeout_s,
            backend="nccl" if rc.replicate_backend == "nccl" else "gloo",
            device=self.device,
            host=route_address(transport.coordinator_address()),
        )
        self.manager.attach(self.replicate_groups, self.device, self.parallel_dims.world_size)
        self.replica_slots = replica_ids(job_config)
        self.expert_counts = titan.expert_counts(self)  # MoE load balancing's, summed with the gradients
        self.exact: exact.ExactSum | None = None
        if rc.exact:
            self.exact = exact.ExactSum(sum(g.numel() for g in self._grads()), self.num_microbatches, self.device)
            self.optimizers.zero_grad()  # the zeros _grads() made to count them
        self.checks: Checks | None = None
        self._models_told = False  # whether the members' device models were looked at (once, at the first step)
        if rc.sdc_check:
            self.checks = Checks(
                rc.data_seed, rc.sdc_check_rate, self.num_microbatches, replica, self.replica_slots, self.device
            )
        self.speeds = workload.Speeds()  # seconds per microbatch of each replica, from committed steps
        self._synced_epoch = -1  # the last epoch in which this rank received the state
        self._started = False  # its first should_continue_training: a state saved at a stop is newer?
        self.stop_root = stop_folder(job_config, titan.dump_folder(job_config))
        self.snapshot_root = os.environ.get(keys.SNAPSHOT_DIR_ENV, "")  # the launcher's folder; "": none
        self._stop_rate: snapshot.Probe | None = None  # a save's rate into the stop folder, measured at the first start
        self._verified: tuple[int, dict[str, Any], torch.Tensor] | None = None  # the newest snapshot read at a join
        self.snapshots = self._snapshot_writer(rc)  # copies of the committed state in this node's memory
        # DCP checkpoints stay a backstop: one replica group saves (the step's leader), and a
        # rejoining group never loads one: its state comes from a live peer
        self._leader = True
        titan.guard_checkpointer(
            self,
            saves=lambda: self._leader,
            loads=not self.manager.rejoining,
            failed=lambda step, why: self.events.emit(
                "checkpoint_failed", step=step, replica=replica, rank=group_rank, error=why
            ),
        )

    def init_distributed(self) -> Any:
        """This torchrun world is one replica group: TorchTitan sees dp_replicate = 1;
        the replicate dimension is titan_recover's, across jobs.

        TorchTitan's groups keep its settings (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``: a failed in-group
        collective takes the process down, its group dies as one anyway); the replicate groups are built
        with their own (``collectives.NCCL_GROUP_ENV``)."""
        par = self.job_config.parallelism
        replicas, par.data_parallel_replicate_degree = par.data_parallel_replicate_degree, 1
        try:
            return super().init_distributed()
        finally:
            par.data_parallel_replicate_degree = replicas

    def _note_run_notice(self) -> None:
        """SIGTERM on the node whose notice stops the run: the coordinator stops it; this rank notes when."""
        if self._run_noticed_at is None:
            self._run_noticed_at = time.time()

    def _epoch_view(self) -> Callable[[], int]:
        return self.manager.channel.epoch

    def _on_fault(self, fault: Fault) -> None:
        self.manager.report_fault(self._fault_record(fault))
        super()._on_fault(fault)

    # ---- rejoin: admission and state transfer -----------------------------------------

    def should_continue_training(self) -> bool:
        if self.manager.rejoining and self._synced_epoch < 0:
            try:
                self._join()
            except RunDone:
                self.log.info("the run finished before it could rejoin")
                return False
        elif not self._started:  # after TorchTitan's own load, before the first step
            self._resume_from_stop()
            self._probe_stop_folder()
        self._started = True
        return super().should_continue_training()

    def _join(self) -> None:
        """Waits for the coordinator to admit this group, then takes the state from a live peer, or, where every
        group had lost it, from the nodes' snapshots of the step the coordinator resumes from."""
        admission = self.manager.wait_for_admission(
            self.step, self.job_config.parallelism.data_parallel_replicate_degree, self._verified_snapshots
        )
        verified, self._verified = self._verified, None  # held for this resume only
        if admission.resume_step is not None:
            self._resume_from_memory(admission, verified)
            return
        epoch = self.manager.agree_epoch()
        while not self.manager.group_all(self._receive_state(epoch)):
            epoch = self.manager.agree_epoch(newer_than=epoch)
        self.step -= 1  # TorchTitan's loop adds one before the step we join in

    def _receive_state(self, epoch: int) -> bool:
        """Takes the state from this group rank's donor in ``epoch``; False if that broke."""
        if self.replica not in self.manager.membership(epoch).members:
            raise ReplicaFenced(f"replica {self.replica} was fenced out in epoch {epoch} while rejoining")
        try:
            with self.manager.transfer_group(epoch, self.replica, donor=False) as group:
                start = time.perf_counter()
                header, nbytes = transfer.receive(
                    self.replicate_groups,
                    group,
                    self.model_parts,
                    self.optimizers,
                    abort=lambda: self.manager.epoch_moved(epoch),
                    after_header=lambda h: self.injector.at(h.get("step"), "join"),
                )
        except CollectiveAborted as e:
            self.manager.report_broken(
                epoch, f"state transfer to replica {self.replica} rank {self.group_rank} broke", e
            )
            return False
        elapsed = time.perf_counter() - start
        step = self._take_header(header, "state transfer header", epoch)
        self.manager.record_transfer(TransferRecord(nbytes, elapsed, step, epoch))
        self.log.info(f"received {nbytes / 2**20:.1f} MiB of state for step {step} in {elapsed:.3f}s (epoch {epoch})")
        return True

    def _take_header(self, header: dict[str, Any], what: str, epoch: int, base_epoch: int | None = None) -> int:
        """Takes the counters, schedules and speeds of a state whose tensors are in place (received, or loaded
        from a snapshot, whose group starts anew in ``base_epoch``); returns the header's step."""
        step, sent_epoch, tokens = (header.get(k) for k in ("step", "base_epoch", "ntokens_seen"))
        if not (isinstance(step, int) and isinstance(sent_epoch, int) and isinstance(tokens, int)):
            raise MessageError(f"{what} has bad counters: step {step!r}, base_epoch {sent_epoch!r}")
        try:
            speeds = workload.Speeds.from_json(header.get("speeds"))
        except workload.WorkloadError as e:
            raise MessageError(f"{what}: {e}") from e
        if self.exact is not None:
            bound = header.get("exact_bound")
            if (
                not isinstance(bound, int)
                or isinstance(bound, bool)
                or not exact.LOW_EXPONENT <= bound <= exact.HIGH_EXPONENT + exact.MARGIN_BITS
            ):
                raise MessageError(
                    f"{what} has no valid exact_bound (got {bound!r}): was it written with recover.exact?"
                )
            self.exact.bound = bound
        if self._synced_epoch >= 0 and step != self.step:
            raise transfer.TransferError(f"donor is at step {step}, this rank at {self.step}")
        transfer.restore(header, self.optimizers, self.lr_schedulers)
        self.step, self.ntokens_seen, self.speeds = step, tokens, speeds
        self.manager.base_epoch = sent_epoch if base_epoch is None else base_epoch
        self._synced_epoch = epoch
        return step

    # ---- host-memory snapshots ---------------------------------------------------------

    def _snapshot_writer(self, rc: Any) -> snapshot.SnapshotWriter | None:
        """This rank's writer into its launcher's folder, once the folder is checked to hold the snapshots of every
        rank on this node (``snapshot.room_needed``; the state counts the AdamW moments a fresh optimizer lacks)."""
        root = self.snapshot_root
        if rc.snapshot_interval <= 0 or not root:
            return None
        state = transfer.state_bytes(self.model_parts, self.optimizers)
        ranks = int(os.environ.get(keys.NODE_RANKS_ENV, "1"))
        shards = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))  # torchrun's: this group's ranks on this node
        try:
            snapshot.check_room(root, snapshot.room_needed(state, rc.snapshot_keep, ranks, shards))
            return snapshot.SnapshotWriter(root, self.group_rank, rc.snapshot_keep)
        except snapshot.SnapshotError as e:  # the node's setup, not a fault: a restart would meet it again
            self.manager.report_failure(0, e)  # the run stops, saying why
            raise

    def _state_header(self, base_epoch: int) -> dict[str, Any]:
        """What a state transfer (at the start of step ``self.step``) or a snapshot (of committed step
        ``self.step``) carries besides the tensors."""
        return transfer.meta(
            {
                "step": self.step,
                "base_epoch": base_epoch,
                "ntokens_seen": self.ntokens_seen,
                "speeds": self.speeds.to_json(),  # the joiner derives the same quotas from here on
                **({"exact_bound": self.exact.bound} if self.exact is not None else {}),
            },
            self.optimizers,
            self.lr_schedulers,
        )

    def _snapshot(self, current: Membership) -> None:
        """Step ``self.step`` committed: its state goes into this node's memory (``write`` returns once it is
        copied; the file is written meanwhile)."""
        assert self.snapshots is not None
        header = self._state_header(current.epoch)
        try:
            self.snapshots.write(self.step, header, transfer.state_tensors(self.model_parts, self.optimizers))
        except snapshot.SnapshotError as e:  # the safety net has a hole, the training goes on: say so
            self._snapshot_failed(e)
            return
        w = self.snapshots
        if self.group_rank == 0 and w.last_bytes:  # write() waited for the previous one: its figures are final
            self.log.info(
                f"previous snapshot: {w.last_bytes / 2**20:.1f} MiB copied in {w.last_copy_s:.3f}s, "
                f"written in {w.last_write_s:.3f}s"
            )

    def _snapshot_failed(self, e: snapshot.SnapshotError) -> None:
        """A snapshot that could not be copied or written (a full folder, a slow disk): the run trains on, and a
        loss of every group resumes from an older copy, or stops for the last checkpoint."""
        self.log.error(f"host-memory snapshot failed, training goes on: {e}")
        self.events.emit("snapshot_failed", step=self.step, replica=self.replica, rank=self.group_rank, error=str(e))

    def _verified_snapshots(self) -> Snapshots:
        """The steps whose snapshot of this rank's shard is on this node and checks out, newest first; the newest
        one's contents are kept for the resume (one copy of the state in host memory while the rank waits)."""
        root = self.snapshot_root
        good: list[int] = []
        for step in snapshot.inventory(root, self.group_rank) if root else []:
            try:
                header, payload = snapshot.load(root, self.group_rank, step)
            except snapshot.SnapshotError as e:
                self.log.warning(f"snapshot of step {step} is not used: {e}")
                continue
            if not good:  # the newest, which a resume loads unless another shard lacks it: kept, not read again
                self._verified = (step, header, payload)
            good.append(step)
        self.log.info(f"snapshots on this node that check out: steps {good}")
        return Snapshots(tuple(good[:MAX_SNAPSHOTS]))

    def _resume_from_memory(
        self, admission: Admission, verified: tuple[int, dict[str, Any], torch.Tensor] | None
    ) -> None:
        """Every group lost its state: this rank loads the snapshot of the step the coordinator resumes from where its
        node holds this shard's copy (the one ``verified`` read, where it is that step's), and hands it to the same
        rank of the admitted groups that lack one; a rank whose node does not hold it receives it from one that
        does. A group that did not get every shard raises: it leaves, is fenced, and comes back to rejoin from a
        member."""
        step, epoch = admission.resume_step, admission.epoch
        assert step is not None
        members = self.manager.membership(epoch).members
        holders = admission.holders.get(self.group_rank, members)
        if not set(holders) <= set(members) or not holders:
            raise MessageError(
                f"admission of epoch {epoch} names holders {holders} of shard {self.group_rank} "
                f"outside its members {members}"
            )
        lacking = [r for r in members if r not in holders]
        if self.replica in holders:
            what = f"this node's snapshot of step {step}"
            loaded = verified[1:] if verified is not None and verified[0] == step else None
            self._apply_snapshot(self.snapshot_root, step, what, epoch, epoch, loaded)
            for joiner in lacking:
                if membership.donor(Membership(epoch, members), lacking, joiner) == self.replica:
                    self._send_state(epoch, joiner)  # a receiver that broke is fenced; this group goes on
            ok = True
        else:
            ok = self._receive_state(epoch)
        if not self.manager.group_all(ok):
            raise transfer.TransferError(
                f"replica {self.replica} did not get every shard of step {step} in the resume from memory"
            )

    def _apply_snapshot(
        self,
        root: str,
        step: int,
        what: str,
        epoch: int,
        base_epoch: int,
        loaded: tuple[dict[str, Any], torch.Tensor] | None = None,
    ) -> None:
        """Loads this shard's file of committed step ``step`` under ``root`` (``what``, as the lines name it;
        ``loaded``: its contents, already read and verified) into the model and optimizer, and its header's
        counters: a snapshot is of committed step S (TorchTitan's loop adds one), where a transfer's header names
        the step it starts."""
        start = time.perf_counter()
        header, payload = loaded or snapshot.load(root, self.group_rank, step)
        snapshot.apply(header, payload, self.model_parts, self.optimizers)
        self._take_header(header, what, epoch, base_epoch=base_epoch)
        self.log.info(f"resumed from {what} ({payload.numel() / 2**20:.1f} MiB) in {time.perf_counter() - start:.3f}s")

    def _save_stop(self) -> None:
        """The run stops in order after committed step ``self.step``: this shard's state goes to the stop folder,
        written once per shard by the first group to claim it (whichever groups read the stop before leaving),
        so the same command resumes here with DCP checkpoints on or off. A failure is said; the run still stops."""
        start = time.perf_counter()
        try:
            if not snapshot.claim(self.stop_root, self.group_rank, self.step):
                return  # another group writes this shard
            tensors = transfer.state_tensors(self.model_parts, self.optimizers)
            self._check_notice_budget(transfer.nbytes(tensors))
            writer = snapshot.SnapshotWriter(self.stop_root, self.group_rank, keep=1, durable=True)
            try:
                writer.write(self.step, self._state_header(self.manager.base_epoch), tensors)
            finally:
                writer.close()
        except snapshot.SnapshotError as e:
            self.log.error(f"the state at the stop (step {self.step}) was not saved: {e}")
            self.events.emit(
                "snapshot_failed", step=self.step, replica=self.replica, rank=self.group_rank, error=str(e)
            )
            return
        seconds = time.perf_counter() - start
        self.log.info(
            f"saved shard {self.group_rank}'s state of step {self.step} to {self.stop_root} in {seconds:.2f}s"
        )
        self.events.emit(
            "stop_saved", step=self.step, replica=self.replica, rank=self.group_rank, seconds=round(seconds, 3)
        )

    def _probe_stop_folder(self) -> None:
        """Once, before the first step: the rate of a save into the stop folder (checksum and fsynced write),
        measured by every rank (each saves its own shard at a stop, all at once: their probes meet that
        contention, and each has its figure at the notice with no collective). Where a whole-job notice's save of
        this shard would not fit ``recover.notice_budget_s``, a warning and a ``stop_save_short`` event; where the
        folder cannot be written, a warning. It costs the probe: at most ``snapshot.PROBE_BYTES``, checksummed
        and written once."""
        state = transfer.state_bytes(self.model_parts, self.optimizers)
        probed = min(snapshot.PROBE_BYTES, state)
        folder = snapshot.shard_dir(self.stop_root, self.group_rank)
        self.manager.tick("measuring the rate of a save into the stop folder")
        try:
            probe = snapshot.save_rate(folder, probed)
        except snapshot.SnapshotError as e:
            self.log.warning(f"the stop {e}: a whole-job notice cannot save this shard's state there")
            return
        self._stop_rate = probe
        if not probe.finished:
            self.log.warning(
                f"a save of {stop_budget.amount(probed)} into the stop folder {folder} "
                f"took over {snapshot.PROBE_TIMEOUT_S:g} s: under {stop_budget.amount(probe.rate)}/s"
            )
        fit = stop_budget.SaveFit(state, probe.rate, self.rc.notice_budget_s)
        if fit.fits:
            self.log.info(
                "a whole-job notice's save of this shard's state fits recover.notice_budget_s: "
                + fit.numbers(f"within the {fit.budget_s:g} s budget")
            )
            return
        self.log.warning(stop_budget.at_start(fit))
        self._emit_stop_short("start", fit)

    def _check_notice_budget(self, state: int) -> None:
        """At the stop, before this shard's save: where the rate measured at start says it will not land in the
        time left of the notice (all of ``recover.notice_budget_s`` where this process was not told when the notice
        came), a warning naming where the next run starts instead, and a ``stop_save_short`` event."""
        if self._stop_rate is None:  # not measured: a group that joined, or a folder that could not be written
            return
        noticed = self.manager.noticed_at or self._run_noticed_at
        left = self.rc.notice_budget_s - (time.time() - noticed if noticed is not None else 0.0)
        fit = stop_budget.SaveFit(state, self._stop_rate.rate, left)
        if fit.fits:
            return
        dcp = titan.newest_checkpoint(os.path.dirname(self.stop_root)) if self.checkpointer.enable else None
        earlier = snapshot.newest_complete(self.stop_root, self.parallel_dims.world_size)
        self.log.warning(stop_budget.at_notice(fit, self.step, stop_budget.fallback(dcp, earlier)))
        self._emit_stop_short("notice", fit, fallback_step=stop_budget.fallback_step(dcp, earlier))

    def _emit_stop_short(self, at: str, fit: stop_budget.SaveFit, **extra: Any) -> None:
        self.events.emit(
            "stop_save_short",
            at=at,
            step=self.step,
            replica=self.replica,
            rank=self.group_rank,
            bytes=fit.state_bytes,
            rate=round(fit.rate),
            needed_s=round(fit.needed_s, 3),
            budget_s=round(fit.budget_s, 3),
            **extra,
        )

    def _resume_from_stop(self) -> None:
        """A run that stopped in order saved its state (``_save_stop``): where that step is newer than what
        TorchTitan loaded (a DCP checkpoint, or none), every group starts from it. A file that does not verify
        stops the run, naming it: no group may start elsewhere."""
        step = snapshot.newest_complete(self.stop_root, self.parallel_dims.world_size)
        if step is None or step <= self.step:
            return
        try:
            what = f"the state saved at the stop of step {step}"
            self._apply_snapshot(self.stop_root, step, what, -1, self.manager.base_epoch)
        except (snapshot.SnapshotError, transfer.TransferError, MessageError) as e:
            error = snapshot.SnapshotError(
                f"the state saved at the stop of step {step} in {self.stop_root} cannot be used: {e}. Remove that "
                "folder to start from the last DCP checkpoint instead (or from scratch without one)"
            )
            self.manager.report_failure(0, error)  # the run stops, saying why
            raise error from e
        self.events.emit("stop_resumed", step=step, replica=self.replica, rank=self.group_rank)

    def _send_state(self, epoch: int, joiner: int) -> bool:
        """Hands this rank's state to the same group rank of ``joiner``; False if that broke."""
        header = self._state_header(self.manager.base_epoch)
        try:
            with self.manager.transfer_group(epoch, joiner, donor=True) as group:
                nbytes = transfer.send(
                    self.replicate_groups,
                    group,
                    header,
                    self.model_parts,
                    self.optimizers,
                    abort=lambda: self.manager.epoch_moved(epoch),
                    after_header=lambda: self.injector.at(self.step, "donate"),
                )
        except CollectiveAborted as e:
            cause = f"state transfer from replica {self.replica} rank {self.group_rank} to replica {joiner} broke"
            self.manager.report_broken(epoch, cause, e)
            return False
        self.log.info(f"sent {nbytes / 2**20:.1f} MiB of state to replica {joiner} (epoch {epoch})")
        return True

    def _sync_state(self, history: list[Membership]) -> bool:
        """Before any work in an epoch: donors send, rejoiners receive the step's starting state.

        Members (re)admitted during this step take part in its all-reduce with no
        microbatches of their own, so they end the step with everyone's state.
        Returns the same answer on every rank of this group; False: retry in a newer epoch.
        """
        joining = membership.joiners(history)
        if not joining:
            return True
        current = history[-1]
        ok = True
        if self.replica in joining:
            if current.epoch > self._synced_epoch:
                ok = self._receive_state(current.epoch)
        else:
            for joiner in joining:
                if membership.donor(current, joining, joiner) == self.replica:
                    ok = self._send_state(current.epoch, joiner) and ok
        return self.manager.group_all(ok)

    # ---- the step -------------------------------------------------------------------

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        """Assignment -> accumulate owned microbatches -> FT all-reduce -> agreement -> commit,
        retried in the next epoch (keeping what was computed) until the step commits."""
        epoch = self.manager.start_step(self.step)
        self.optimizers.zero_grad()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        tally = steps.new_tally(self.num_microbatches, self.replica_slots)
        done: set[int] = set()
        synced = -1  # the epoch this step's state was handed over in (a redo stays in it)
        if self.exact is not None:
            self.exact.reset()
        checked = self.checks.begin(self.step) if self.checks is not None else None
        try:
            while True:
                history = self.manager.history(epoch)
                current = history[-1]
                if current.epoch != synced:
                    if not self._sync_state(history):
                        epoch = self.manager.agree_epoch(newer_than=epoch)
                        continue
                    synced = current.epoch
                assignment = steps.step_assignment(self.rc.policy, history, self.num_microbatches, self.speeds.rates())
                owned = assignment[self.replica]
                for m in owned:
                    if m not in done:
                        self._compute(m, tally, len(done), len(owned))
                        done.add(m)
                if self.checks is not None and checked is not None:
                    self.checks.ask(next(r for r, ms in assignment.items() if checked in ms), current.members)
                    if self.checks.wants_duplicate():
                        self._duplicate(checked)
                latest = self.manager.settled_epoch(epoch)  # past an epoch that still holds a group that left
                if latest != epoch:
                    epoch = latest  # membership changed while computing: take on more work first
                    continue
                buffers = self._reduction_buffers(tally)
                reduced = self.manager.allreduce(
                    current,
                    buffers,
                    on_launched=lambda: self.injector.at(self.step, "allreduce"),
                )
                if reduced:
                    coarser = self.exact.redo_bound(buffers[2]) if self.exact is not None else None
                    verdict = self.checks.read(buffers[3], self.parallel_dims.world_size) if self.checks else None
                    if self.checks is not None and not self._models_told:
                        self._tell_models(self.checks.models(buffers[3]))
                    disagree = verdict is not None and not verdict.agree
                    decision = self.manager.should_commit(current, redo=coarser is not None or disagree)
                    if decision == COMMIT:
                        break
                    if decision == REDO and verdict is not None and disagree:  # before any grid's redo
                        again = self._disagreed(verdict, current)
                        if again == RECOMPUTE:
                            tally, done = steps.new_tally(self.num_microbatches, self.replica_slots), set()
                        if again != NEXT_EPOCH:
                            continue
                    elif decision == REDO:
                        assert coarser is not None  # every member read the same histogram
                        self._redo(coarser)
                        tally, done = steps.new_tally(self.num_microbatches, self.replica_slots), set()
                        continue
                epoch = self.manager.agree_epoch(newer_than=epoch)
        except Exception as e:
            self.manager.report_failure(epoch, e)
            raise
        self._commit(current, buffers, lr)

    def _redo(self, bound: int) -> None:
        """Every member read the same overflow of the exact grid: the step again, on the grid
        that holds its largest gradient (below ``2**bound``)."""
        assert self.exact is not None
        if self.group_rank == 0:
            self.events.emit(
                "exact_redo", step=self.step, replica=self.replica, bound=self.exact.bound, new_bound=bound
            )
        self.log.info(
            f"step {self.step}'s gradients reach 2**{bound}, past the "
            f"exact grid's 2**{self.exact.bound}: every replica redoes the step on the coarser grid"
        )
        self.exact.bound = bound
        self.exact.reset()
        balancing.reset(self.expert_counts)

    def _disagreed(self, verdict: sdc.Verdict, current: Membership) -> str:
        """Every member read the same mismatch of the checked microbatch's digests. Where one group is outvoted two
        to one, it fails in the step (``ReplicaOutvoted``, reported as its failure) and the others go on in the
        next epoch without it (``NEXT_EPOCH``); where two disagree, a third group is asked (``THIRD``: the same
        epoch, the work kept). With two groups there is no third: the step is computed again from its start, once
        (``RECOMPUTE``: a transient fault gives way); a second mismatch, or three opinions without a majority,
        stop the run (``CheckUndecided``), since a wrong gradient would otherwise train in."""
        assert self.checks is not None and self.checks.microbatch is not None
        m, asked = self.checks.microbatch, self.checks.opinions
        if verdict.outvoted:
            outcome = NEXT_EPOCH
        elif len(asked) == 2 and self.checks.ask_third(current.members) is not None:
            outcome = THIRD
        elif len(asked) == 2 and len(current.members) == 2 and not self.checks.recomputed:
            outcome = RECOMPUTE
        else:
            outcome = "undecided"
        reporter = next(r for r in current.members if r not in verdict.outvoted)
        if self.group_rank == 0 and self.replica == reporter:
            self.events.emit(
                "sdc_mismatch",
                step=self.step,
                microbatch=m,
                groups=list(asked),
                outvoted=list(verdict.outvoted),
                outcome=outcome,
            )
        where = f"step {self.step} microbatch {m}"
        if outcome == NEXT_EPOCH:
            self.log.error(
                f"replicas {list(verdict.outvoted)}' gradient of {where} differs from two other groups' (silent "
                "data corruption): each fails in the step, and the others compute its microbatches"
            )
            if self.replica in verdict.outvoted:
                raise ReplicaOutvoted(f"replica {self.replica}: its gradient of {where} was outvoted two to one")
        elif outcome == THIRD:
            self.log.warning(
                f"replicas {list(asked)} computed different gradients of {where}: replica "
                f"{self.checks.opinions[-1]} computes it for a third opinion"
            )
        elif outcome == RECOMPUTE:
            self.log.warning(
                f"replicas {list(asked)} computed different gradients of {where}, and there is no third group to "
                "tell which is wrong: the step is computed again from its start, without either contribution"
            )
            assert self.exact is not None  # the checks are exact mode's
            self.checks.recomputed, self.checks.mine = True, 0
            self.exact.reset()
            balancing.reset(self.expert_counts)
        else:
            raise CheckUndecided(
                f"the gradients of {where} computed by replicas {list(asked)} give no majority (silent data "
                "corruption on more than one group, or on one of two twice): the step does not commit, and the "
                "run stops; resume it from its last checkpoint with the suspect nodes left out"
            )
        return outcome

    def _tell_models(self, models: int) -> None:
        """At the first all-reduce: a warning where the members' groups run on different device models, whose
        gradients may differ in their bits with no corruption (a check would then fail them)."""
        self._models_told = True
        if models > 1 and self.group_rank == 0:
            self.log.warning(
                f"recover.sdc_check: the replica groups run on {models} different device models, whose gradients "
                "may differ in their last bits with no corruption; a check would outvote a healthy group. Run the "
                "checks on groups of one device model"
            )

    def _duplicate(self, microbatch: int) -> None:
        """The checked microbatch computed on top of this group's quota, for its digest only: outside the exact
        sum, the tally, the token counts and the MoE load counts. A bad device's flip (``repeat=true``) fires
        here too; a once-only flip names one of the group's own microbatches, so never this one."""
        self.manager.tick(f"the check of microbatch {microbatch} of step {self.step}")
        counts = [transfer.local(c).clone() for c in self.expert_counts]
        inputs, labels = self.dataloader.load(self.step, microbatch)
        input_dict, targets = titan.model_inputs(self, inputs.to(self.device), labels.to(self.device))
        self.forward_backward_step(input_dict=input_dict, labels=targets, global_valid_tokens=self.valid_tokens)
        grads = self._grads()
        self.injector.flip(self.step, -1, 1, grads)
        assert self.checks is not None
        self.checks.note(microbatch, grads)
        for part in self.model_parts:
            part.zero_grad(set_to_none=True)
        with torch.no_grad():
            for c, saved in zip(self.expert_counts, counts):
                transfer.local(c).copy_(saved)

    def _compute(self, microbatch: int, tally: torch.Tensor, index: int, count: int) -> None:
        self.manager.tick(f"microbatch {microbatch} of step {self.step}")
        start = time.perf_counter()
        inputs, labels = self.dataloader.load(self.step, microbatch)
        self.metrics_processor.data_loading_times.append(time.perf_counter() - start)
        digest = addressing.piece_digest(inputs, labels) if self.reports_data else 0  # of the CPU copy
        with self.injector.microbatch(self.model_parts[0], self.step, index, count):
            input_dict, targets = titan.model_inputs(self, inputs.to(self.device), labels.to(self.device))
            loss = self.forward_backward_step(
                input_dict=input_dict, labels=targets, global_valid_tokens=self.valid_tokens
            )
        if self.exact is not None:  # this microbatch's gradient alone onto the fixed-point sum
            grads = self._grads()
            self.injector.flip(self.step, index, count, grads)  # a bad device's wrong gradient, before it is summed
            if self.checks is not None:
                self.checks.note(microbatch, grads)
            self.exact.add(grads, f"step {self.step} microbatch {microbatch}")
            for part in self.model_parts:  # the next backward writes its gradient afresh: no zeroing, no adding
                part.zero_grad(set_to_none=True)
        tokens = int((labels != titan.IGNORE_INDEX).sum())
        if self.reports_data:
            steps.tally_microbatch(tally, microbatch, digest, tokens, loss.detach())
        if (factor := self.injector.slow_factor(self.step)) > 1:  # a straggler, for tests and benches
            time.sleep((factor - 1) * (time.perf_counter() - start))
        if self.group_rank == 0:  # one rank per replica times it: every rank reads the same sum
            steps.tally_time(tally, self.replica_slots, self.replica, time.perf_counter() - start)
        titan.count_tokens(self, labels)

    def _grads(self) -> list[torch.Tensor]:
        """Each parameter's local gradient, laid out like the parameter. TP can leave a
        gradient Partial or Replicate where its parameter is Replicate or Shard; it is
        redistributed first, so every replica (and a rejoiner's zeros) flattens the same shapes."""
        grads = []
        for m in self.model_parts:
            for p in m.parameters():
                if p.requires_grad:
                    if p.grad is None:  # a rejoiner owns no microbatch in the step it joins
                        p.grad = torch.zeros_like(p)
                    elif isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                        p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                    grads.append(transfer.local(p.grad))
        return grads

    def _reduction_buffers(self, tally: torch.Tensor) -> list[torch.Tensor]:
        """Fresh copies of the local gradients and of the group's summed tally (in exact mode, of the
        fixed-point sum and its histogram, summed inside the group so every rank reads the same
        overflow; with ``sdc_check``, the checked microbatch's digest per group; last, the MoE layers' token
        counts where the optimizer balances experts): the replicate
        all-reduce is out-of-place, so a broken one leaves the local state intact."""
        group_tally = tally.to(self.device, copy=True)
        if self.manager.leave_agreed and self.group_rank == 0:  # the members know at the commit that it leaves
            steps.tally_leaving(group_tally, self.replica_slots, self.replica)
        extra = [] if self.exact is None else [self.exact.histogram.clone()]
        if self.parallel_dims.world_size > 1:
            for t in (group_tally, *extra):
                dist.all_reduce(t)  # inside the group: sum over its ranks
        if self.checks is not None:  # each group's digest of the checked microbatch (this shard's), in its own slot
            extra.append(self.checks.slots())
        flat = torch.cat([g.reshape(-1) for g in self._grads()]) if self.exact is None else self.exact.total.clone()
        self.ft_buffer_bytes = flat.numel() * flat.element_size()  # the one extra gradient copy
        counts = [balancing.gather(self.expert_counts)] if self.expert_counts else []
        return [flat, group_tally, *extra, *counts]

    def _optimizer_step(self) -> float:
        grad_norm = titan.clip_grad_norm(self)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        return grad_norm.item()

    def _commit(self, current: Membership, buffers: list[torch.Tensor], lr: float) -> None:
        flat, tally = buffers[:2]
        summary = steps.summarize(tally, self.parallel_dims.dp_shard, int(self.global_tokens), self.replica_slots)
        # a leaver's report now: its epoch is out before the next all-reduce
        self.manager.announce(summary.leaving, current.members)
        self.speeds = workload.update_speeds(
            self.speeds,
            summary.seconds_per_microbatch,
            current.members,
            self.num_microbatches,
            self.rc.speed_smoothing,
            self.rc.rebalance_threshold,
        )
        with torch.no_grad():
            grads, offset = self._grads(), 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            if self.exact is not None:  # the grid points, as values
                self.exact.scale(grads)
                self.exact.committed(buffers[2])
        if self.expert_counts:  # the optimizer's pre-hook moves the expert biases by every group's counts
            balancing.scatter(self.expert_counts, buffers[-1])
        self.injector.at(self.step, "optimizer", self.model_parts[0])
        grad_norm = self._optimizer_step()
        after_failure = self.manager.committed(current)
        torn_down, reformed = self.replicate_groups.moments()  # this step's, if its epoch changed
        self._leader = self.replica == current.members[0]
        if self.checks is not None and self.checks.microbatch is not None and self._leader and self.group_rank == 0:
            self.events.emit(
                "sdc_checked", step=self.step, microbatch=self.checks.microbatch, groups=list(self.checks.opinions)
            )
        if self.group_rank == 0:
            # every member offers the record, the first one counts
            record = self._step_record(
                summary, current.epoch, list(current.members), grad_norm, self.manager.commit_round_s
            )
            if self.checks is not None and self.checks.microbatch is not None:  # who the step's check vouched for
                record = dataclasses.replace(record, checked=[r for r in self.checks.opinions if r in current.members])
            self.manager.publish_step(record)
            if after_failure:  # leaks would show here, failure after failure
                self.events.emit(
                    "recovery_moments",
                    replica=self.replica,
                    epoch=current.epoch,
                    step=self.step,
                    torn_down=torn_down,
                    reformed=reformed,
                    aborted=self.manager.aborted,
                )
                self.events.emit(
                    "resources",
                    process="rank",
                    replica=self.replica,
                    rank=self.group_rank,
                    step=self.step,
                    parked=self.replicate_groups.parked(),
                    **resources.usage(),
                )
        if self.step % self.rc.digest_interval == 0 or self.step == self.job_config.training.steps:
            self._check_param_digest(current)
        if self.snapshots is not None and self.step % self.rc.snapshot_interval == 0:
            self._snapshot(current)
        if self.metrics_processor.should_log(self.step):
            if not self.metrics_processor.data_loading_times:
                self.metrics_processor.data_loading_times.append(0.0)  # computed nothing since the last log
            extra = {"n_tokens_seen": self.ntokens_seen, "lr": lr}
            if self.logs_recovery:
                extra |= self._recovery_metrics(current, summary)
            self.metrics_processor.log(self.step, summary.loss, summary.loss, grad_norm, extra_metrics=extra)

    def _recovery_metrics(self, current: Membership, summary: steps.StepSummary) -> dict[str, float]:
        """The run's recovery figures for TensorBoard/W&B: this step's, and the coordinator's counts
        as it last saved them (read from the store only at log steps, only when a logger wants them)."""
        out = {
            "recover/live_groups": float(len(current.members)),
            "recover/microbatches": float(summary.quotas.get(self.replica, 0)),
        }
        state = self.manager.control.read_state()
        if state is not None:
            out |= {"recover/failures": float(state.failures), "recover/rejoins": float(state.rejoins)}
            if state.last_recovery_s is not None:
                out["recover/last_recovery_latency_s"] = state.last_recovery_s
            if state.last_downtime_s is not None:
                out["recover/last_rejoin_downtime_s"] = state.last_downtime_s
        return out

    def _param_digest(self) -> str:
        """A digest of this replica's full model state (parameters and persistent buffers such as
        the MoE expert biases): every shard, in order."""
        mine = torch.tensor(
            list(_digest(transfer.model_tensors(m) for m in self.model_parts)), dtype=torch.int64, device=self.device
        )
        shards = [mine]
        if self.parallel_dims.world_size > 1:
            shards = [torch.empty_like(mine) for _ in range(self.parallel_dims.world_size)]
            dist.all_gather(shards, mine)
        return hashlib.blake2b(bytes(torch.cat(shards).tolist()), digest_size=8).hexdigest()

    def _check_param_digest(self, current: Membership) -> None:
        """Logs the digest and compares it with every member's. A replica whose parameters
        differ from the majority's (the leader's when two disagree) reports itself and
        restarts: it rejoins with a live peer's state instead of training on diverged weights."""
        digest = self._param_digest()
        ok = True
        if self.group_rank == 0:
            buffers = [transfer.persistent_buffers(m) for m in self.model_parts]
            self.events.emit(  # the buffers' own digest shows an MoE layer's expert bias moving, step by step
                "param_digest",
                step=self.step,
                replica=self.replica,
                digest=digest,
                buffers=_digest(buffers).hex() if any(buffers) else None,
            )
            digests = self.manager.exchange_digests(current.members, digest)
            if self.replica in diverged(digests, current.members[0]):
                expected = sorted(set(digests.values()) - {digest})
                self.events.emit(
                    "param_digest_mismatch", step=self.step, replica=self.replica, digest=digest, expected=expected
                )
                log.error(
                    f"replica {self.replica} parameters differ from the others' at step {self.step}: "
                    f"{digest} != {expected}; it leaves and rejoins with a live peer's state"
                )
                ok = False
        if not self.manager.group_all(ok):
            cause = f"its parameters diverged from the other replicas' at step {self.step} (digest mismatch)"
            if self.group_rank == 0:
                self.manager.report_diverged(current.epoch, cause)
            raise ReplicaDiverged(f"replica {self.replica}: {cause}")

    def train(self) -> None:
        try:
            super().train()
        except ReplicaLeaving as leaving:  # before a step: every step before it committed, the last with its report
            self.log.info(f"replica {self.replica} {leaving}: the other groups take its quota")
        except RunStopping as stopping:  # every group stops at this boundary; the step's leader saves
            self.log.info(f"replica {self.replica} {stopping}")
            self.step = stopping.step  # the checkpoint's train state: the step its parameters are of
            self._save_stop()
            self.checkpointer.save_whole(stopping.step)
        else:
            if self.step >= self.job_config.training.steps:  # the run ended: a state saved at a stop is spent
                shutil.rmtree(snapshot.shard_dir(self.stop_root, self.group_rank), ignore_errors=True)
                # the last rank's, once empty: the start's probe made them, and TorchTitan's own folder only
                # matters where checkpoints are on
                made = [self.stop_root] + ([] if self.checkpointer.enable else [os.path.dirname(self.stop_root)])
                for folder in made:
                    with contextlib.suppress(OSError):
                        os.rmdir(folder)
        self.manager.finish()

    def close(self) -> None:
        super().close()
        if self.snapshots is not None:
            try:
                self.snapshots.close()  # the copy in flight is whole before the rank goes
            except snapshot.SnapshotError as e:
                self._snapshot_failed(e)
        self.manager.close()
        self.events.close()  # what it still keeps is written, or said to be lost


def _digest(parts: Iterable[list[tuple[str, torch.Tensor]]]) -> bytes:
    """blake2b (8 bytes) over the tensors' bytes, in order."""
    h = hashlib.blake2b(digest_size=8)
    for tensors in parts:
        for _, t in tensors:
            h.update(host_bytes(t))
    return h.digest()


def name_wandb_run(replica: int) -> None:
    """Each replica group is a W&B run of its own, resumed by every incarnation (one history per
    group), grouped under the run's public id; a name or id the user set is kept as a prefix."""
    run = Run.from_env().public_id
    for key, default in (("WANDB_RUN_ID", run), ("WANDB_RUN_NAME", "")):
        prefix = os.environ.get(key) or default
        os.environ[key] = f"{prefix}-replica{replica}" if prefix else f"replica{replica}"
    os.environ.setdefault("WANDB_RUN_GROUP", run)
    os.environ.setdefault("WANDB_RESUME", "allow")
