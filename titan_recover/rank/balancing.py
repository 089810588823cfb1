"""MoE load balancing under the invariant: the expert bias moves with the counts of all M microbatches.

TorchTitan's aux-loss-free balancing counts each MoE layer's tokens per expert in forward and, in
an optimizer pre-hook, sums the counts over its ``loss`` mesh and nudges each expert's bias. Inside
a replica group that mesh holds the group's own ranks only, so the counts of the other groups'
microbatches join the replicate all-reduce here, beside the gradients: the same out-of-place,
epoch-fenced sum, so a step that survivors finish counts each of its M microbatches once (a dead
group's partial counts die with it) and the hook then sees the failure-free run's totals. Counts
are summed in float64, exact far past what one step routes.
"""

import torch

from titan_recover.rank import transfer


def gather(counts: list[torch.Tensor]) -> torch.Tensor:
    """A float64 copy of this rank's counts, one layer after another, for the all-reduce."""
    return torch.cat([transfer.local(c).reshape(-1).to(torch.float64) for c in counts])


def scatter(counts: list[torch.Tensor], summed: torch.Tensor) -> None:
    """Puts the replicate-summed counts back into the layers' buffers, for the optimizer's pre-hook."""
    offset = 0
    with torch.no_grad():
        for c in counts:
            local = transfer.local(c)
            local.copy_(summed[offset : offset + local.numel()].view_as(local))
            offset += local.numel()


def reset(counts: list[torch.Tensor]) -> None:
    """Forgets the counts of a step that is computed again from its start (an exact-mode redo)."""
    with torch.no_grad():
        for c in counts:
            transfer.local(c).zero_()
