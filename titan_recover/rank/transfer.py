"""Checkpoint-free rejoin: a live rank hands a restarted rank everything the step needs.

The donor is the rank with the same group rank in a live replica group; both
sides hold the same model and optimizer layout, so each lists the same tensors
from its own objects and the bytes go straight into the joiner's tensors. Over
the two-rank replicate-dim group (donor = rank 0; on ``groups.device``: the CPU for
gloo, the rank's GPU for NCCL) go three broadcasts:

1. ``int64 [header bytes, payload bytes]``
2. the header, JSON (never pickle): step, base epoch, tokens seen, LR scheduler
   state, optimizer hyperparameters, the manifest ``[[name, dtype, shape], ...]``
   and the payload's checksum
3. the payload: the tensors' bytes in manifest order (parameters, persistent buffers
   such as an MoE layer's expert bias, optimizer state, the CPU RNG state, and the CUDA
   one on GPUs)

The joiner checks the manifest against its own before taking any byte; a
mismatch is a ``TransferError`` naming the first difference. It checks the payload's
checksum before copying it into its tensors; a mismatch is a ``MessageError``. The
data loader needs nothing: its whole position is the step number.
"""

import json
from typing import Any, Callable, NamedTuple

import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state

from titan_recover.control.protocol import MessageError
from titan_recover.rank.collectives import ReplicateProcessGroups

MAX_HEADER_BYTES = 64 << 20  # a larger header is a corrupted message, not a model
RNG = "rng/cpu"
CUDA_RNG = "rng/cuda"
HYPER_TYPES = (int, float, bool, str, type(None))  # param-group entries the LR schedule may change
CHECKSUM_CHUNK = 1 << 22  # 8-byte words per checksum pass: bounds its temporaries to 2 x 32 MiB


class TransferError(RuntimeError):
    """The donor's (or a snapshot's) state does not fit this rank's model or optimizer."""


class Source(NamedTuple):
    """Where the state a rank takes comes from, as its errors name it."""

    name: str
    verb: str
    hint: str


DONOR = Source("the donor", "sent", "are both replica groups running the same model, optimizer and parallelism?")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly FSDP DTensor) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint holds (an MoE layer's expert bias, which the optimizer step moves;
    not tables rebuilt at init, nor a step's token counts), as named local tensors. Persistence is
    read from each module's own set: an activation-checkpoint wrapper renames the state dict's keys."""
    return [
        (f"{prefix}.{name}" if prefix else name, local(b))
        for prefix, module in model.named_modules()
        for name, b in module.named_buffers(recurse=False)
        if name not in module._non_persistent_buffers_set
    ]


def model_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's state as a checkpoint holds it: parameters, then persistent buffers, as named local shards."""
    return [(name, local(p.data)) for name, p in model.named_parameters()] + persistent_buffers(model)


def state_tensors(model_parts: list[torch.nn.Module], optimizers: Any) -> list[tuple[str, torch.Tensor]]:
    """This rank's share of the training state, as named local tensors (live, not copies)."""
    tensors = []
    for i, model in enumerate(model_parts):
        tensors += [(f"model{i}/{name}", t) for name, t in model_tensors(model)]
    for i, opt in enumerate(optimizers.optimizers):
        for g, group in enumerate(opt.param_groups):
            for j, p in enumerate(group["params"]):
                for key, value in sorted(opt.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        tensors.append((f"optim{i}/g{g}/p{j}/{key}", local(value)))
    tensors.append((RNG, torch.get_rng_state()))
    if torch.cuda.is_available():
        tensors.append((CUDA_RNG, torch.cuda.get_rng_state()))
    return tensors


def nbytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    """Bytes of named tensors as a buffer, a transfer or a snapshot holds them."""
    return sum(t.numel() * t.element_size() for _, t in tensors)


def state_bytes(model_parts: list[torch.nn.Module], optimizers: Any) -> int:
    """Bytes of this rank's state as a snapshot or a stop's save holds it once the optimizer has stepped: a
    parameter the optimizer keeps no state for yet (before its first step) counts the two moments of its
    size Adam and AdamW make then."""
    total = nbytes(state_tensors(model_parts, optimizers))
    for opt in optimizers.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state.get(p):
                    total += 2 * local(p).numel() * p.element_size()
    return total


def meta(trainer_state: dict[str, Any], optimizers: Any, lr_schedulers: Any) -> dict[str, Any]:
    """The non-tensor state: the trainer's counters, LR schedulers and hyperparameters."""
    return {
        **trainer_state,
        "lr_schedulers": [s.state_dict() for s in lr_schedulers.schedulers],
        "param_groups": [
            [{k: v for k, v in group.items() if isinstance(v, HYPER_TYPES)} for group in opt.param_groups]
            for opt in optimizers.optimizers
        ],
    }


def manifest(tensors: list[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    return [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors]


def pack(
    tensors: list[tuple[str, torch.Tensor]],
    device: torch.device = torch.device("cpu"),
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tensors' bytes in order, as one buffer on ``device`` (state may span CPU and GPU).

    Each tensor is copied once, straight into its slice; ``out`` (uint8, on ``device``, of the
    state's size) is reused rather than allocated, as a snapshot writer does from one write to the next.
    """
    total = nbytes(tensors)
    if out is None or out.numel() != total or out.device != device:
        out = torch.empty(total, dtype=torch.uint8, device=device)
    offset = 0
    for _, t in tensors:
        n = t.numel() * t.element_size()
        out[offset : offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        offset += n
    return out


def unpack(payload: torch.Tensor, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Copies the payload's bytes into ``tensors`` in place."""
    offset = 0
    with torch.no_grad():
        for _, t in tensors:
            n = t.numel() * t.element_size()
            chunk = payload[offset : offset + n]
            if offset % t.element_size():
                chunk = chunk.clone()  # a dtype view needs an aligned start
            t.copy_(chunk.view(t.dtype).view(t.shape))
            offset += n


def checksum(payload: torch.Tensor) -> int:
    """Sum of (2i + 1) x word i over the payload's 8-byte words (the last one zero-padded), mod 2**64.

    Computed with torch ops where the payload lives (a GPU for NCCL): no host copy, one
    pass. The weights are odd, hence invertible mod 2**64, so any change within one word
    changes the sum, and equal words in different places weigh differently. int64
    arithmetic wraps, and sums mod 2**64 do not depend on order: every device and thread
    count gives the same value. A check against corruption, not against a forger.
    """
    n = payload.numel()
    whole = n - n % 8
    words = payload[:whole].view(torch.int64)
    tail = torch.zeros(8, dtype=torch.uint8, device=payload.device)
    tail[: n - whole] = payload[whole:]
    weights = torch.arange(1, 2 * min(CHECKSUM_CHUNK, words.numel()) + 1, 2, dtype=torch.int64, device=payload.device)
    total = (2 * words.numel() + 1) * tail.view(torch.int64)[0]
    for start in range(0, words.numel(), CHECKSUM_CHUNK):
        chunk = words[start : start + CHECKSUM_CHUNK]
        # weight of word start + i = (2i + 1) + 2 * start
        total += (chunk * weights[: chunk.numel()]).sum() + 2 * start * chunk.sum()
    return int(total.item())


def check_manifest(theirs: object, ours: list[list[Any]], source: Source = DONOR) -> None:
    if not isinstance(theirs, list):
        raise TransferError(f"{source.name}'s tensor manifest is not a list: {theirs!r:.80}")
    if len(theirs) != len(ours):
        raise TransferError(
            f"{source.name} {source.verb} {len(theirs)} tensors, this rank has {len(ours)}: {source.hint}"
        )
    for mine, sent in zip(ours, theirs):
        if mine != sent:
            raise TransferError(f"{source.name}'s tensor {sent} does not match this rank's {mine}")


def is_optim(entry: object) -> bool:
    return isinstance(entry, list) and bool(entry) and str(entry[0]).startswith("optim")


def accept(
    theirs: object, payload_bytes: int, model_parts: list[torch.nn.Module], optimizers: Any, source: Source = DONOR
) -> list[tuple[str, torch.Tensor]]:
    """This rank's tensors that take a sender's state listed by manifest ``theirs``, or a ``TransferError``.

    A fresh optimizer has no state until it steps: if the sender's has, it is created
    first (zero grads, lr 0), as DCP does before loading, then overwritten. The model's
    entries are checked before that, so a different model leaves this rank as it was.
    """
    if isinstance(theirs, list) and any(is_optim(entry) for entry in theirs):
        model_only = [entry for entry in manifest(state_tensors(model_parts, optimizers)) if not is_optim(entry)]
        check_manifest([entry for entry in theirs if not is_optim(entry)], model_only, source)
        for opt in optimizers.optimizers:
            _init_optim_state(opt)
    tensors = state_tensors(model_parts, optimizers)
    check_manifest(theirs, manifest(tensors), source)
    expected = nbytes(tensors)
    if payload_bytes != expected:
        raise TransferError(f"{source.name} {source.verb} {payload_bytes} bytes of state, this rank holds {expected}")
    return tensors


def fill(payload: torch.Tensor, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Copies a checked payload into the tensors ``accept`` gave, and takes its RNG states."""
    unpack(payload, tensors)
    torch.set_rng_state(dict(tensors)[RNG])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(dict(tensors)[CUDA_RNG])


def send(
    groups: ReplicateProcessGroups,
    group: Any,
    header: dict[str, Any],
    model_parts: list[torch.nn.Module],
    optimizers: Any,
    abort: Callable[[], bool],
    after_header: Callable[[], None],
) -> int:
    """The donor's side; returns the payload bytes."""
    tensors = state_tensors(model_parts, optimizers)
    payload = pack(tensors, groups.device)
    raw = json.dumps({**header, "tensors": manifest(tensors), "payload_checksum": checksum(payload)}).encode()
    groups.broadcast(group, torch.tensor([len(raw), payload.numel()], dtype=torch.int64, device=groups.device), abort)
    groups.broadcast(group, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(groups.device), abort)
    after_header()
    groups.broadcast(group, payload, abort)
    return payload.numel()


def receive(
    groups: ReplicateProcessGroups,
    group: Any,
    model_parts: list[torch.nn.Module],
    optimizers: Any,
    abort: Callable[[], bool],
    after_header: Callable[[dict[str, Any]], None],
) -> tuple[dict[str, Any], int]:
    """The joiner's side: fills this rank's tensors; returns (header, payload bytes)."""
    sizes = torch.zeros(2, dtype=torch.int64, device=groups.device)
    groups.broadcast(group, sizes, abort)
    header_len, payload_len = (int(v) for v in sizes)
    if not 0 < header_len <= MAX_HEADER_BYTES or payload_len < 0:
        raise MessageError(f"state transfer sizes are corrupt: header {header_len} B, payload {payload_len} B")
    raw = torch.empty(header_len, dtype=torch.uint8, device=groups.device)
    groups.broadcast(group, raw, abort)
    try:
        header = json.loads(raw.cpu().numpy().tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MessageError(f"state transfer header is not JSON: {e}") from e
    if not isinstance(header, dict) or "tensors" not in header:
        raise MessageError("state transfer header lacks its tensor manifest")
    if not isinstance(header.get("payload_checksum"), int):
        raise MessageError(
            "state transfer header lacks the payload's checksum: do both replica groups run the same titan_recover?"
        )
    tensors = accept(header["tensors"], payload_len, model_parts, optimizers)
    after_header(header)
    payload = torch.empty(payload_len, dtype=torch.uint8, device=groups.device)
    groups.broadcast(group, payload, abort)
    received = checksum(payload)
    if received != header["payload_checksum"]:
        raise MessageError(
            f"state transfer payload is corrupt: its checksum is {received}, the donor's was "
            f"{header['payload_checksum']} ({payload_len} B): it changed between the two ranks; none of it was applied"
        )
    fill(payload, tensors)
    return header, payload_len


def restore(header: dict[str, Any], optimizers: Any, lr_schedulers: Any) -> None:
    """Applies the header's LR scheduler state and optimizer hyperparameters."""
    for scheduler, sd in zip(lr_schedulers.schedulers, header["lr_schedulers"], strict=True):
        scheduler.load_state_dict(sd)
    for opt, groups in zip(optimizers.optimizers, header["param_groups"], strict=True):
        for group, sent in zip(opt.param_groups, groups, strict=True):
            group.update({k: v for k, v in sent.items() if k in group and k != "params"})
