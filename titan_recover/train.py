"""The training entry point: TorchTitan's Trainer with a fault-tolerant replicate dimension.

With ``[recover] enable = true`` each torchrun job is one replica group (a TorchTitan
world of dp_shard x tp x pp ranks; rank k of every group holds the same coordinate, and
the replicate all-reduce joins those) and ``train_step`` runs, top to bottom:

    hand state to rejoiners -> assignment -> accumulate owned microbatches
    -> FT all-reduce -> agreement -> commit

re-entering the loop in a new epoch when membership changes mid-step. A group
the launcher restarted first asks the coordinator to admit it, then receives
parameters, optimizer, scheduler and step from a live peer (no checkpoint read). With
``enable = false`` it is stock TorchTitan HSDP; both modes log the same per-step
events so their trajectories can be compared.

    torchrun ... -m titan_recover.train --job.config_file X.toml   (run_train.sh does this)
"""

import hashlib
import json
import os
import re
import resource
import time
from datetime import timedelta
from typing import Any, Iterator

from titan_recover import cpu_shim

cpu_shim.apply()  # before any torchtitan module binds the device type

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.train import Trainer, main

from titan_recover import data, membership, node_channel, recovery, resources, store, transfer, workload
from titan_recover.collectives import POLL_S, CollectiveAborted, ReplicateGroups, backoff
from titan_recover.config import (
    group_coordinates, is_spare, num_microbatches, replica_ids, reports_data, resume_hint, validate,
)
from titan_recover.events import EventLog
from titan_recover.faults import Fault, FaultInjector
from titan_recover.membership import Membership, diverged
from titan_recover.tokens import DataError

import titan_recover.train_spec  # noqa: F401  registers llama3_recover, qwen3_recover

EPOCH_POLL_S = 0.02  # how stale a rank's view of the epoch may be while it waits


def _brief(e: BaseException) -> str:
    """One line of an error for the event log (gloo's messages run on for paragraphs)."""
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text.split(". This is typically")[0][:200]


PEER_FAILURE = re.compile(r"gloo|nccl|connection|timed out|timeout|closed by peer|broken pipe", re.IGNORECASE)


def own_error(e: BaseException) -> str | None:
    """The error as the same text on every replica that raises it, or None when it may be
    a peer's failure seen from here (a collective broke): only the former can be the job's."""
    if isinstance(e, dist.DistError) or PEER_FAILURE.search(str(e)):
        return None
    return re.sub(r"0x[0-9a-fA-F]+", "0x?", _brief(e))


class ReplicaFenced(RuntimeError):
    """This replica group was declared failed; it must not rejoin this step."""


class RunFailed(RuntimeError):
    """The coordinator stopped the run (e.g. fewer than min_replicas left)."""


class RunFinished(Exception):
    """The run ended while this (rejoining) group was still waiting to take part."""


class ReplicaDiverged(RuntimeError):
    """This replica's parameters differ from the others': it reported itself and restarts."""


def log(msg: str) -> None:
    print(f"[titan_recover] {msg}", flush=True)


class RecoverTrainer(Trainer):
    def __init__(self, job_config: JobConfig) -> None:
        self.rc = validate(job_config)
        self.events = EventLog(job_config.job.dump_folder)
        self._ft_buffer_bytes = 0
        self.attempt = store.attempt()
        if self.rc.enable:
            self.replica = int(os.environ[store.REPLICA_ENV])
            self.shard = int(os.environ["RANK"])
            prof = job_config.profiling  # each group is a torchrun world of its own: rank 0 of every group would share a file
            prof.save_traces_folder = os.path.join(prof.save_traces_folder, f"replica{self.replica}")
            address = store.coordinator_address()
            self.store = store.connect(address, self.rc.startup_timeout_s)  # the coordinator may still be starting
            self.store.set_timeout(timedelta(seconds=self.rc.collective_timeout_s))
            # liveness and epochs go through this node's agent (the launcher), not the coordinator's store
            self.channel = node_channel.Channel.open(os.environ.get(node_channel.CHANNEL_ENV, ""))
            self.slot = int(os.environ["LOCAL_RANK"])
            self.channel.set_state(self.slot, node_channel.STARTING)
            self.heartbeat = node_channel.RankBeat(
                self.channel, self.slot, self.rc.heartbeat_interval_s, self.rc.progress_timeout_s,
                self.rc.coordinator_timeout_s,
                on_lost=lambda reason: store.exit_lost(f"replica {self.replica} rank {self.shard}", reason, resume_hint(job_config)),
            )
        else:
            self.replica, self.shard = group_coordinates(int(os.environ["RANK"]), job_config.parallelism)
        self.reports_data = reports_data(self.shard, job_config.parallelism)
        super().__init__(job_config)
        self.num_microbatches = num_microbatches(job_config)
        self.replica_slots = replica_ids(job_config) if self.rc.enable else 0
        self.speeds = workload.Speeds()  # seconds per microbatch of each replica, from committed steps
        self.injector = FaultInjector(self.rc.fault_plan, self.replica, self.shard, self._on_fault, self.attempt)
        self.global_tokens = float(self.dataloader.valid_tokens_per_step())
        if self.rc.enable:
            self.groups = ReplicateGroups(
                self.store, self.replica, self.shard, self.rc.collective_timeout_s,
                backend="nccl" if self.rc.replicate_backend == "nccl" else "gloo", device=self.device,
            )
            self.base_epoch = 0  # the epoch the previous step committed with
            self._memberships: dict[int, Membership] = {}
            self._epoch_checked = (0.0, 0)
            # a restarted group, or a hot spare, holds no state until a peer sends it
            self.rejoining = self.attempt > 0 or is_spare(self.replica, job_config)
            self._synced_epoch = -1  # the last epoch in which this rank received the state
            self._start_told = False
            self._adapt_checkpointer()

    def init_distributed(self) -> Any:
        """In recover mode this torchrun world is one replica group: TorchTitan sees
        dp_replicate = 1; the replicate dimension is titan_recover's, across jobs."""
        par = self.job_config.parallelism
        if not self.rc.enable:
            return super().init_distributed()
        replicas, par.data_parallel_replicate_degree = par.data_parallel_replicate_degree, 1
        try:
            return super().init_distributed()
        finally:
            par.data_parallel_replicate_degree = replicas

    # ---- shared by both modes -------------------------------------------------------

    def _adapt_checkpointer(self) -> None:
        """DCP checkpoints stay a backstop: one replica group saves (the step's leader),
        and a rejoining group never loads one: its state comes from a live peer."""
        save, self._leader = self.checkpointer.save, True

        def save_if_leader(curr_step: int, last_step: bool = False) -> None:
            if self._leader:
                save(curr_step, last_step)

        self.checkpointer.save = save_if_leader  # type: ignore[method-assign]
        if self.rejoining:
            self.checkpointer.load = lambda step=-1: False  # type: ignore[method-assign]

    def _on_fault(self, fault: Fault) -> None:
        record = {"replica": self.replica, "rank": self.shard, "attempt": self.attempt, "step": self.step, "phase": fault.phase}
        if self.rc.enable:
            store.put_json(self.store, store.fault_key(self.replica), {**record, "time": time.time()})
        self.events.emit("fault_injected", action=fault.action, **record)

    def _step_record(self, summary: recovery.StepSummary, epoch: int, members: list[int], grad_norm: float | None) -> dict[str, Any]:
        """What the event log says about a committed step (the same in both modes)."""
        return {
            "step": self.step,
            "epoch": epoch,
            "members": members,
            "microbatches": list(summary.microbatches),
            "data_digest": summary.data_digest,
            "loss": summary.loss,
            "grad_norm": grad_norm,
            "time": time.time(),
            "data_epochs": self.dataloader.epochs_started(self.step),
            "quotas": {str(r): n for r, n in summary.quotas.items()},
            "seconds_per_microbatch": {str(r): t for r, t in summary.seconds_per_microbatch.items()},
            "samples": self.dataloader.windows,
        }

    def _optimizer_step(self) -> float:
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm,
            foreach=True,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"),
            ep_enabled=self.parallel_dims.ep_enabled,
        )
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        return grad_norm.item()

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        if self.rc.enable:
            self._recover_step()
        else:
            self._stock_step(data_iterator)

    # ---- stock TorchTitan HSDP (enable = false) -----------------------------------

    def _stock_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        """Stock ``train_step``, plus one small all-reduce to log the same step event
        (and the fault plan's forward/backward faults, for checkpoint-and-restart baselines)."""
        tally = recovery.new_tally(self.num_microbatches)
        ids = iter(self.dataloader.failure_free_ids)
        self._stock_pieces: list[tuple[int, int, int]] = []
        self._stock_losses: list[torch.Tensor] = []

        def tallied() -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            for input_dict, labels in data_iterator:
                piece = (next(ids), data.piece_digest(input_dict["input"], labels), int((labels != IGNORE_INDEX).sum()))
                self._stock_pieces.append(piece)
                yield input_dict, labels

        super().train_step(tallied())
        if self.reports_data:
            for (m, digest, tokens), loss in zip(self._stock_pieces, self._stock_losses):
                recovery.tally_microbatch(tally, m, digest, tokens, loss)
        tally = tally.to(self.device)  # on GPUs the world's group is NCCL
        dist.all_reduce(tally)
        summary = recovery.summarize(tally, self.parallel_dims.dp_shard, int(self.global_tokens))
        if dist.get_rank() == 0:
            members = list(range(self.parallel_dims.dp_replicate))
            self.events.step(self._step_record(summary, 0, members, None))

    def forward_backward_step(self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor) -> torch.Tensor:
        if self.rc.enable:
            return super().forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        index, count = len(self._stock_losses), self.gradient_accumulation_steps
        with self.injector.microbatch(self.model_parts[0], self.step, index, count):
            loss = super().forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        self._stock_losses.append(loss.detach())
        return loss

    # ---- titan_recover (enable = true) ----------------------------------------------

    def _membership(self, epoch: int) -> Membership:
        if epoch not in self._memberships:
            raw = store.get_json(self.store, store.members_key(epoch), ("epoch", "members"))
            self._memberships[epoch] = Membership.from_json(raw)
        return self._memberships[epoch]

    def _store_epoch(self) -> int:
        """The latest epoch, as this node's agent pushed it into the channel (-1: none yet)."""
        self.heartbeat.tick(f"waiting at step {self.step}")  # a loop that polls is not stuck
        self.channel.set_step(self.slot, self.step)
        flags = self.channel.flags()
        if flags & node_channel.FATAL:
            raise RunFailed(store.get_json(self.store, store.FATAL, ("error",))["error"])
        if self.rejoining and flags & node_channel.DONE:
            raise RunFinished()  # the groups with state finished without us
        return self.channel.epoch()

    def _epoch_moved(self, epoch: int) -> bool:
        """Throttled check whether the coordinator has published a newer epoch."""
        last_time, last_epoch = self._epoch_checked
        now = time.monotonic()
        self.heartbeat.tick(f"in a collective at step {self.step}")
        if now - last_time >= EPOCH_POLL_S:
            self._epoch_checked = (now, self._store_epoch())
        return self._epoch_checked[1] > epoch

    def _agree_epoch(self, newer_than: int = -1) -> int:
        """The epoch every rank of this replica group continues in (max of their views)."""
        deadline = time.monotonic() + self.rc.collective_timeout_s
        while (epoch := self._store_epoch()) <= newer_than:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no epoch after {newer_than} within {self.rc.collective_timeout_s}s")
            time.sleep(EPOCH_POLL_S)
        if self.parallel_dims.world_size > 1:
            t = torch.tensor([epoch], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            epoch = int(t.item())
        return epoch

    def _group_all(self, ok: bool) -> bool:
        """True only if every rank of this replica group says so (they then act alike)."""
        if self.parallel_dims.world_size > 1:
            t = torch.tensor([int(ok)], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            ok = bool(t.item())
        return ok

    # ---- rejoin: admission and state transfer -----------------------------------------

    def should_continue_training(self) -> bool:
        if self.rc.enable and self.rejoining and self._synced_epoch < 0:
            try:
                self._join()
            except RunFinished:
                log(f"replica {self.replica} rank {self.shard}: the run finished before it could rejoin")
                return False
        return super().should_continue_training()

    def _join(self) -> None:
        """Asks the coordinator to admit this restarted group, then takes the state from a live peer."""
        self.channel.set_state(self.slot, node_channel.READY)  # the agent tells the coordinator
        log(f"replica {self.replica} rank {self.shard} (attempt {self.attempt}) asks to join; "
            "it waits as a hot spare while the membership is full")
        key, looked = store.admitted_key(self.replica, self.attempt), -2
        while True:  # an admission comes with a new epoch: the store is read only then
            epoch = self._store_epoch()  # raises if the run failed or finished meanwhile
            if epoch != looked:
                if self.store.check([key]):
                    break
                looked = epoch
            time.sleep(EPOCH_POLL_S)
        self.channel.set_state(self.slot, node_channel.RUNNING)
        epoch = self._agree_epoch()
        while not self._group_all(self._receive_state(epoch)):
            epoch = self._agree_epoch(newer_than=epoch)
        self.step -= 1  # TorchTitan's loop adds one before the step we join in

    def _receive_state(self, epoch: int) -> bool:
        """Takes the state from this shard's donor in ``epoch``; False if that broke."""
        if self.replica not in self._membership(epoch).members:
            raise ReplicaFenced(f"replica {self.replica} was fenced out in epoch {epoch} while rejoining")
        try:
            with self.groups.pair(epoch, self.replica, donor=False, abort=lambda: self._epoch_moved(epoch)) as group:
                start = time.perf_counter()
                header, nbytes = transfer.receive(
                    self.groups, group, self.model_parts, self.optimizers,
                    abort=lambda: self._epoch_moved(epoch),
                    after_header=lambda h: self.injector.at(h.get("step"), "join"),
                )
        except CollectiveAborted as e:
            self._report_broken(epoch, f"state transfer to replica {self.replica} rank {self.shard} broke", e)
            return False
        elapsed = time.perf_counter() - start
        step, base_epoch, tokens = (header.get(k) for k in ("step", "base_epoch", "ntokens_seen"))
        if not all(isinstance(v, int) for v in (step, base_epoch, tokens)):
            raise store.MessageError(f"state transfer header has bad counters: step {step!r}, base_epoch {base_epoch!r}")
        try:
            speeds = workload.Speeds.from_json(header.get("speeds"))
        except workload.WorkloadError as e:
            raise store.MessageError(f"state transfer header: {e}") from e
        if self._synced_epoch >= 0 and step != self.step:
            raise transfer.TransferError(f"donor is at step {step}, this rank at {self.step}")
        transfer.restore(header, self.optimizers, self.lr_schedulers)
        self.step, self.base_epoch, self.ntokens_seen, self.speeds = step, base_epoch, tokens, speeds
        self._synced_epoch = epoch
        store.put_json(
            self.store, store.transfer_key(self.replica, self.shard),
            {"bytes": nbytes, "transfer_s": elapsed, "step": step, "epoch": epoch},
        )
        log(f"replica {self.replica} rank {self.shard}: received {nbytes / 2**20:.1f} MiB of state "
            f"for step {step} in {elapsed:.3f}s (epoch {epoch})")
        return True

    def _send_state(self, epoch: int, joiner: int) -> bool:
        """Hands this rank's state to the same shard of ``joiner``; False if that broke."""
        header = transfer.meta(
            {"step": self.step, "base_epoch": self.base_epoch, "ntokens_seen": self.ntokens_seen,
             "speeds": self.speeds.to_json()},  # the joiner derives the same quotas from here on
            self.optimizers, self.lr_schedulers,
        )
        try:
            with self.groups.pair(epoch, joiner, donor=True, abort=lambda: self._epoch_moved(epoch)) as group:
                nbytes = transfer.send(
                    self.groups, group, header, self.model_parts, self.optimizers,
                    abort=lambda: self._epoch_moved(epoch),
                    after_header=lambda: self.injector.at(self.step, "donate"),
                )
        except CollectiveAborted as e:
            self._report_broken(epoch, f"state transfer from replica {self.replica} rank {self.shard} to replica {joiner} broke", e)
            return False
        log(f"replica {self.replica} rank {self.shard}: sent {nbytes / 2**20:.1f} MiB of state to replica {joiner} (epoch {epoch})")
        return True

    def _report_broken(self, epoch: int, cause: str, e: BaseException) -> None:
        """Tells the coordinator a replicate-dim collective broke, without knowing whose fault."""
        if not self._epoch_moved(epoch):  # a peer broke it, not a newer epoch
            store.report(self.store, {"replica": self.replica, "shard": self.shard, "epoch": epoch, "step": self.step, "suspect": None, "cause": f"{cause}: {_brief(e)}"})

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
        return self._group_all(ok)

    # ---- the step -------------------------------------------------------------------

    def _compute(self, microbatch: int, tally: torch.Tensor, index: int, count: int) -> None:
        self.heartbeat.tick(f"microbatch {microbatch} of step {self.step}")
        start = time.perf_counter()
        inputs, labels = self.dataloader.load(self.step, microbatch)
        self.metrics_processor.data_loading_times.append(time.perf_counter() - start)
        digest = data.piece_digest(inputs, labels) if self.reports_data else 0  # of the CPU copy
        with self.injector.microbatch(self.model_parts[0], self.step, index, count):
            loss = self.forward_backward_step(
                input_dict={"input": inputs.to(self.device)}, labels=labels.to(self.device),
                global_valid_tokens=self.global_tokens,
            )
        tokens = int((labels != IGNORE_INDEX).sum())
        if self.reports_data:
            recovery.tally_microbatch(tally, microbatch, digest, tokens, loss.detach())
        if (factor := self.injector.slow_factor(self.step)) > 1:  # a straggler, for tests and benches
            time.sleep((factor - 1) * (time.perf_counter() - start))
        if self.shard == 0:  # one rank per replica times it: every rank reads the same sum
            recovery.tally_time(tally, self.replica_slots, self.replica, time.perf_counter() - start)
        self.ntokens_seen += labels.numel()
        self.metrics_processor.ntokens_since_last_log += labels.numel()

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

    def _reduce_and_agree(self, membership: Membership, tally: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Out-of-place FT all-reduce of gradients + tally, then the agreement round.

        Returns the reduced (gradients, tally) when the step commits in this epoch,
        None when it must be retried in the next one (local gradients untouched).
        """
        epoch = membership.epoch
        group_tally = tally.to(self.device, copy=True)
        if self.parallel_dims.world_size > 1:
            dist.all_reduce(group_tally)  # inside the group: sum over shards
        flat = torch.cat([g.reshape(-1) for g in self._grads()])
        self._ft_buffer_bytes = flat.numel() * flat.element_size()  # the one extra gradient copy
        try:
            self.groups.allreduce(
                membership,
                [flat, group_tally],
                abort=lambda: self._epoch_moved(epoch),
                on_launched=lambda: self.injector.at(self.step, "allreduce"),
            )
        except CollectiveAborted as e:
            self._report_broken(epoch, f"replicate all-reduce broke (replica {self.replica} rank {self.shard})", e)
            return None
        expected = len(membership.members) * self.parallel_dims.world_size
        decision = store.decision_key(self.step, epoch)
        if self.store.add(store.ok_key(self.step, epoch), 1) == expected:
            self.store.compare_set(decision, "", "commit")
        pause = POLL_S[0]
        while not self.store.check([decision]):
            if self._epoch_moved(epoch):
                self.store.compare_set(decision, "", "abort")
            else:
                pause = backoff(pause)  # slower replicas: spare the CPU
        return (flat, group_tally) if self.store.get(decision) == b"commit" else None

    def _recover_step(self) -> None:
        if not self.rejoining and not self._start_told:  # after start or a DCP resume: records begin after it
            self.store.compare_set(store.START_STEP, "", str(self.step - 1))
            self._start_told = True
        self.optimizers.zero_grad()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        tally = recovery.new_tally(self.num_microbatches, self.replica_slots)
        done: set[int] = set()
        epoch = self._agree_epoch()
        try:
            while True:
                history = [self._membership(e) for e in range(self.base_epoch, epoch + 1)]
                membership = history[-1]
                if self.replica not in membership.members:
                    raise ReplicaFenced(f"replica {self.replica} was fenced out in epoch {epoch}")
                if not self._sync_state(history):
                    epoch = self._agree_epoch(newer_than=epoch)
                    continue
                owned = recovery.step_assignment(self.rc.policy, history, self.num_microbatches, self.speeds.rates())[self.replica]
                for m in owned:
                    if m not in done:
                        self._compute(m, tally, len(done), len(owned))
                        done.add(m)
                latest = self._agree_epoch()
                if latest != epoch:
                    epoch = latest  # membership changed while computing: take on more work first
                    continue
                reduced = self._reduce_and_agree(membership, tally)
                if reduced is not None:
                    break
                epoch = self._agree_epoch(newer_than=epoch)
        except (ReplicaFenced, RunFailed, recovery.InvariantError, transfer.TransferError, store.MessageError):
            raise
        except DataError as e:  # the data, not this group, is broken: every replica would meet it
            store.put_json(self.store, store.FATAL, {"error": f"DataError: {e}"})
            raise
        except Exception as e:
            # an error inside this group (a peer of ours died, or our own error): the whole group is lost
            record = {"replica": self.replica, "shard": self.shard, "epoch": epoch, "step": self.step, "suspect": self.replica}
            error = own_error(e)
            cause = f"rank {self.shard} raised {error}" if error else f"rank {self.shard} saw its own group fail: {_brief(e)}"
            store.report(self.store, {**record, "cause": cause, **({"error": error} if error else {})})
            raise
        self._commit(membership, *reduced, lr)

    def _commit(self, membership: Membership, flat: torch.Tensor, tally: torch.Tensor, lr: float) -> None:
        summary = recovery.summarize(tally, self.parallel_dims.dp_shard, int(self.global_tokens), self.replica_slots)
        self.speeds = workload.update_speeds(
            self.speeds, summary.seconds_per_microbatch, membership.members, self.num_microbatches,
            self.rc.speed_smoothing, self.rc.rebalance_threshold,
        )
        offset = 0
        with torch.no_grad():
            for g in self._grads():
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self.injector.at(self.step, "optimizer", self.model_parts[0])
        grad_norm = self._optimizer_step()
        after_failure = membership.epoch != self.base_epoch and not self.rejoining
        self.base_epoch = membership.epoch
        self.rejoining = False  # from here on this group holds the state like any member
        self._leader = self.replica == membership.members[0]
        if self.shard == 0:
            # every member offers the record, the first one counts: a member dying after the commit loses nothing
            record = self._step_record(summary, membership.epoch, list(membership.members), grad_norm)
            self.store.compare_set(store.step_key(self.step), "", json.dumps(record))
            if after_failure:  # leaks would show here, failure after failure
                self.events.emit("resources", process="rank", replica=self.replica, rank=self.shard, step=self.step,
                                 parked=self.groups.parked(), **resources.usage())
        if self.step % self.rc.digest_interval == 0 or self.step == self.job_config.training.steps:
            self._check_param_digest(membership)
        if self.metrics_processor.should_log(self.step):
            if not self.metrics_processor.data_loading_times:
                self.metrics_processor.data_loading_times.append(0.0)  # computed nothing since the last log
            self.metrics_processor.log(
                self.step, summary.loss, summary.loss, grad_norm,
                extra_metrics={"n_tokens_seen": self.ntokens_seen, "lr": lr},
            )

    def _param_digest(self) -> str:
        """A digest of this replica's full parameter state: every shard, in order."""
        h = hashlib.blake2b(digest_size=8)
        for m in self.model_parts:
            for p in m.parameters():
                h.update(transfer.local(p.data).detach().contiguous().view(torch.uint8).cpu().numpy())
        mine = torch.tensor(list(h.digest()), dtype=torch.int64, device=self.device)
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
        if self.shard == 0:
            self.events.emit("param_digest", step=self.step, replica=self.replica, digest=digest)
            self.store.set(store.digest_key(self.step, self.replica), digest)
            keys = {r: store.digest_key(self.step, r) for r in current.members}
            deadline = time.monotonic() + self.rc.collective_timeout_s
            while not self.store.check(list(keys.values())) and time.monotonic() < deadline:
                live = self._membership(self._store_epoch()).members  # a member fenced meanwhile never writes
                keys = {r: k for r, k in keys.items() if r in live}
                time.sleep(EPOCH_POLL_S)
            digests = {r: self.store.get(k).decode() for r, k in keys.items() if self.store.check([k])}
            if self.replica in diverged(digests, current.members[0]):
                expected = sorted(set(digests.values()) - {digest})
                self.events.emit("param_digest_mismatch", step=self.step, replica=self.replica, digest=digest, expected=expected)
                log(f"ERROR: replica {self.replica} parameters differ from the others' at step {self.step}: "
                    f"{digest} != {expected}; it leaves and rejoins with a live peer's state")
                ok = False
        if not self._group_all(ok):
            cause = f"its parameters diverged from the other replicas' at step {self.step} (digest mismatch)"
            if self.shard == 0:
                store.report(self.store, {"replica": self.replica, "shard": self.shard, "epoch": current.epoch,
                                          "step": self.step, "suspect": self.replica, "cause": cause})
            raise ReplicaDiverged(f"replica {self.replica}: {cause}")

    def train(self) -> None:
        super().train()
        self.events.emit(
            "rank_memory", replica=self.replica, rank=self.shard,
            max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            ft_buffer_mb=self._ft_buffer_bytes / 2**20,
        )
        if self.rc.enable:
            self.channel.set_state(self.slot, node_channel.FINISHED)
            self.heartbeat.stop()


if __name__ == "__main__":
    from titan_recover.launch import die_with_parent, dumps_stacks

    die_with_parent()  # a SIGKILLed torchrun agent (or its launcher) takes its ranks along
    dumps_stacks()
    main(RecoverTrainer)
