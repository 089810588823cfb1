"""One rank's part in ``[recover] sdc_check``: the checked microbatch's digest, its slot in the all-reduce, and the
group's reading of every group's digests (``policy.sdc`` decides; this holds the step's state and the tensors)."""

from __future__ import annotations

import platform

import torch
import torch.distributed as dist

from titan_recover.policy import sdc


class ReplicaOutvoted(RuntimeError):
    """Two other groups' gradients of a checked microbatch agree, and this group's differs: it fails in the step,
    and its report is a strike (``Report.outvoted``) towards its quarantine."""


class CheckUndecided(RuntimeError):
    """The groups' digests of a checked microbatch give no majority: the step cannot commit, and the run stops."""


def host_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, on the host (a digest reads them there)."""
    return t.detach().contiguous().view(torch.uint8).cpu().numpy().data


class Checks:
    """The step's check: which microbatch (``policy.sdc.checked_microbatch``), which groups are to compute it, and
    this group's digest of it on this rank's shards (0 until computed)."""

    def __init__(
        self, seed: int, rate: float, num_microbatches: int, replica: int, replica_slots: int, device: torch.device
    ) -> None:
        self.seed, self.rate, self.num_microbatches = seed, rate, num_microbatches
        self.replica, self.replica_slots, self.device = replica, replica_slots, device
        self.model = sdc.digest([device_model(device).encode()])  # what this rank's bits depend on, once
        self.microbatch: int | None = None
        self.opinions: tuple[int, ...] = ()  # the groups asked for it: its owner, the checker, maybe a third
        self.mine = 0
        self.recomputed = False  # a two-group mismatch computed the step again

    def begin(self, step: int) -> int | None:
        """The microbatch ``step`` checks (None: none), its digests forgotten."""
        self.microbatch = sdc.checked_microbatch(self.seed, step, self.rate, self.num_microbatches)
        self.opinions, self.mine, self.recomputed = (), 0, False
        return self.microbatch

    def ask(self, owner: int, members: tuple[int, ...]) -> None:
        """The checked microbatch's owner in this epoch and the member after it (where there is one) compute it;
        a third opinion asked for already stays asked."""
        checker = sdc.after(owner, members)
        asked = (owner,) + ((checker,) if checker is not None else ())
        self.opinions = asked + tuple(r for r in self.opinions if r not in asked and r in members)

    def ask_third(self, members: tuple[int, ...]) -> int | None:
        """The member after the two that disagree, asked for its opinion; None where there is none."""
        third = sdc.after(self.opinions[-1], members, skip=self.opinions)
        if third is not None:
            self.opinions += (third,)
        return third

    def wants_duplicate(self) -> bool:
        """Whether this group computes the checked microbatch on top of its quota (it is asked, and has not)."""
        return self.microbatch is not None and self.replica in self.opinions and not self.mine

    def note(self, microbatch: int, grads: list[torch.Tensor]) -> None:
        """Records this rank's digest of ``microbatch``'s gradient where it is the checked one."""
        if microbatch == self.microbatch:
            self.mine = sdc.digest([host_bytes(g) for g in grads if g.numel()])

    def slots(self) -> torch.Tensor:
        """This group's digest in its replica slot, zeros elsewhere, then its device model's digest in its slot:
        summed over the groups by the all-reduce."""
        out = torch.zeros(2 * self.replica_slots, dtype=torch.int64, device=self.device)
        out[self.replica] = self.mine
        out[self.replica_slots + self.replica] = self.model
        return out

    def read(self, reduced: torch.Tensor, group_size: int) -> sdc.Verdict:
        """The verdict over every shard of the group: each rank's reduced slots, gathered inside the group, so
        every rank of every group reads the same. A step that checks nothing (every rank draws alike) agrees
        without the gather."""
        if self.microbatch is None:
            return sdc.Verdict(agree=True)
        digests = reduced[: self.replica_slots].contiguous()
        shards = [digests]
        if group_size > 1:
            shards = [torch.empty_like(digests) for _ in range(group_size)]
            dist.all_gather(shards, digests)
        return sdc.verdict([{g: v for g, v in enumerate(s.tolist()) if v} for s in shards])

    def models(self, reduced: torch.Tensor) -> int:
        """How many device models the members' ranks of this shard run on (their digests, summed into slots)."""
        return len({v for v in reduced[self.replica_slots :].tolist() if v})


def device_model(device: torch.device) -> str:
    """What a device's bits depend on: its model (an accelerator's name, a CPU's architecture)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}:{platform.machine()}:{platform.processor()}"
