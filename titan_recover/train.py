"""The training entry point: TorchTitan's Trainer with a fault-tolerant replicate dimension.

With ``[recover] enable = true`` each torchrun job is one replica group (FSDP over
``dp_shard``) and ``train_step`` runs, top to bottom:

    assignment -> accumulate owned microbatches -> FT all-reduce -> agreement -> commit

re-entering the loop in a new epoch when membership changes mid-step. With
``enable = false`` it is stock TorchTitan HSDP; both modes log the same per-step
events so their trajectories can be compared.

    torchrun ... -m titan_recover.train --job.config_file X.toml   (run_train.sh does this)
"""

import os
import resource
import time
from typing import Any, Iterator

from titan_recover import cpu_shim

cpu_shim.apply()  # before any torchtitan module binds the device type

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.train import Trainer, main

from titan_recover import data, recovery, store, workload
from titan_recover.collectives import CollectiveAborted, ReplicateGroups
from titan_recover.config import num_microbatches, validate
from titan_recover.events import EventLog
from titan_recover.faults import Fault, FaultInjector
from titan_recover.membership import Membership

import titan_recover.train_spec  # noqa: F401  registers llama3_recover

EPOCH_POLL_S = 0.02  # how stale a rank's view of the epoch may be while it waits


def _brief(e: BaseException) -> str:
    """One line of an error for the event log (gloo's messages run on for paragraphs)."""
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text.split(". This is typically")[0][:200]


class ReplicaFenced(RuntimeError):
    """This replica group was declared failed; it must not rejoin this step."""


class RunFailed(RuntimeError):
    """The coordinator stopped the run (e.g. fewer than min_replicas left)."""


class RecoverTrainer(Trainer):
    def __init__(self, job_config: JobConfig) -> None:
        self.rc = validate(job_config)
        self.events = EventLog(job_config.job.dump_folder)
        self._ft_buffer_bytes = 0
        if self.rc.enable:
            self.replica = int(os.environ[store.REPLICA_ENV])
            self.shard = int(os.environ["RANK"])
            address = store.coordinator_address()
            self.store = store.connect(address, self.rc.collective_timeout_s)
            self.heartbeat = store.Heartbeat(address, self.replica, self.shard, self.rc.heartbeat_interval_s)
        else:
            self.replica, self.shard = divmod(int(os.environ["RANK"]), job_config.parallelism.data_parallel_shard_degree)
        super().__init__(job_config)
        self.num_microbatches = num_microbatches(job_config)
        self.injector = FaultInjector(self.rc.fault_plan, self.replica, self.shard, self._on_fault)
        self.global_tokens = float(self.dataloader.valid_tokens_per_step())
        if self.rc.enable:
            self.groups = ReplicateGroups(self.store, self.replica, self.shard, self.rc.collective_timeout_s)
            self.base_epoch = 0  # the epoch the previous step committed with
            self._memberships: dict[int, Membership] = {}
            self._epoch_checked = (0.0, 0)

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

    def _on_fault(self, fault: Fault) -> None:
        record = {"replica": self.replica, "rank": self.shard, "step": self.step, "phase": fault.phase}
        if self.rc.enable:
            store.put_json(self.store, store.fault_key(self.replica), {**record, "time": time.time()})
        self.events.emit("fault_injected", action=fault.action, **record)

    def _log_step(self, summary: recovery.StepSummary, epoch: int, members: list[int], grad_norm: float | None) -> None:
        self.events.emit(
            "step",
            step=self.step,
            epoch=epoch,
            members=members,
            microbatches=list(summary.microbatches),
            data_digest=summary.data_digest,
            loss=summary.loss,
            grad_norm=grad_norm,
        )

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
        """Stock ``train_step``, plus one small all-reduce to log the same step event."""
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
        for (m, digest, tokens), loss in zip(self._stock_pieces, self._stock_losses):
            recovery.tally_microbatch(tally, m, digest, tokens, loss)
        dist.all_reduce(tally)
        summary = recovery.summarize(tally, self.parallel_dims.dp_shard, int(self.global_tokens))
        if dist.get_rank() == 0:
            members = list(range(self.parallel_dims.dp_replicate))
            self._log_step(summary, 0, members, None)

    def forward_backward_step(self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor) -> torch.Tensor:
        loss = super().forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        if not self.rc.enable:
            self._stock_losses.append(loss.detach())
        return loss

    # ---- titan_recover (enable = true) ----------------------------------------------

    def _membership(self, epoch: int) -> Membership:
        if epoch not in self._memberships:
            raw = store.get_json(self.store, store.members_key(epoch), ("epoch", "members"))
            self._memberships[epoch] = Membership.from_json(raw)
        return self._memberships[epoch]

    def _store_epoch(self) -> int:
        if self.store.check([store.FATAL]):
            raise RunFailed(store.get_json(self.store, store.FATAL, ("error",))["error"])
        return store.get_int(self.store, store.EPOCH)

    def _epoch_moved(self, epoch: int) -> bool:
        """Throttled check whether the coordinator has published a newer epoch."""
        last_time, last_epoch = self._epoch_checked
        now = time.monotonic()
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
            t = torch.tensor([epoch], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            epoch = int(t.item())
        return epoch

    def _compute(self, microbatch: int, tally: torch.Tensor, index: int, count: int) -> None:
        start = time.perf_counter()
        inputs, labels = self.dataloader.load(self.step, microbatch)
        self.metrics_processor.data_loading_times.append(time.perf_counter() - start)
        with self.injector.microbatch(self.model_parts[0], self.step, index, count):
            loss = self.forward_backward_step(
                input_dict={"input": inputs}, labels=labels, global_valid_tokens=self.global_tokens
            )
        tokens = int((labels != IGNORE_INDEX).sum())
        recovery.tally_microbatch(tally, microbatch, data.piece_digest(inputs, labels), tokens, loss.detach())
        self.ntokens_seen += labels.numel()
        self.metrics_processor.ntokens_since_last_log += labels.numel()

    def _grads(self) -> list[torch.Tensor]:
        grads = []
        for m in self.model_parts:
            for p in m.parameters():
                if p.grad is not None:
                    g = p.grad
                    grads.append(g.to_local() if hasattr(g, "to_local") else g)
        return grads

    def _reduce_and_agree(self, membership: Membership, tally: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Out-of-place FT all-reduce of gradients + tally, then the agreement round.

        Returns the reduced (gradients, tally) when the step commits in this epoch,
        None when it must be retried in the next one (local gradients untouched).
        """
        epoch = membership.epoch
        group_tally = tally.clone()
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
            if not self._epoch_moved(epoch):
                store.report(self.store, {"replica": self.replica, "shard": self.shard, "epoch": epoch, "step": self.step, "suspect": None, "cause": f"replicate all-reduce broke (replica {self.replica} rank {self.shard}): {_brief(e)}"})
            return None
        expected = len(membership.members) * self.parallel_dims.world_size
        decision = store.decision_key(self.step, epoch)
        if self.store.add(store.ok_key(self.step, epoch), 1) == expected:
            self.store.compare_set(decision, "", "commit")
        pause = 0.0005
        while not self.store.check([decision]):
            if self._epoch_moved(epoch):
                self.store.compare_set(decision, "", "abort")
            else:
                time.sleep(pause)
                pause = min(2 * pause, 0.004)  # slower replicas: back off, sparing the CPU
        return (flat, group_tally) if self.store.get(decision) == b"commit" else None

    def _recover_step(self) -> None:
        self.optimizers.zero_grad()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        tally = recovery.new_tally(self.num_microbatches)
        done: set[int] = set()
        epoch = self._agree_epoch()
        try:
            while True:
                history = [self._membership(e) for e in range(self.base_epoch, epoch + 1)]
                membership = history[-1]
                if self.replica not in membership.members:
                    raise ReplicaFenced(f"replica {self.replica} was fenced out in epoch {epoch}")
                owned = recovery.step_assignment(self.rc.policy, history, self.num_microbatches)[self.replica]
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
        except (ReplicaFenced, RunFailed, recovery.InvariantError):
            raise
        except Exception as e:
            # an error inside this group (a peer of ours died): the whole group is lost
            store.report(self.store, {"replica": self.replica, "shard": self.shard, "epoch": epoch, "step": self.step, "suspect": self.replica, "cause": f"rank {self.shard} saw its own group fail: {_brief(e)}"})
            raise
        self._commit(membership, *reduced, lr)

    def _commit(self, membership: Membership, flat: torch.Tensor, tally: torch.Tensor, lr: float) -> None:
        summary = recovery.summarize(tally, self.parallel_dims.world_size, int(self.global_tokens))
        offset = 0
        with torch.no_grad():
            for g in self._grads():
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self.injector.at(self.step, "optimizer")
        grad_norm = self._optimizer_step()
        self.base_epoch = membership.epoch
        if self.replica == membership.members[0] and self.shard == 0:
            self.store.set(store.PROGRESS, str(self.step))
            self._log_step(summary, membership.epoch, list(membership.members), grad_norm)
        if self.metrics_processor.should_log(self.step):
            self.metrics_processor.log(
                self.step, summary.loss, summary.loss, grad_norm,
                extra_metrics={"n_tokens_seen": self.ntokens_seen, "lr": lr},
            )

    def train(self) -> None:
        super().train()
        self.events.emit(
            "rank_memory", replica=self.replica, rank=self.shard,
            max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            ft_buffer_mb=self._ft_buffer_bytes / 2**20,
        )
        if self.rc.enable:
            self.store.add(store.finished_key(self.replica), 1)
            self.heartbeat.stop()


if __name__ == "__main__":
    main(RecoverTrainer)
