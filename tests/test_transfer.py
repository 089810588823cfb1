"""Tests for titan_recover.rank.transfer: packing, the manifest check, the header, and a
real donor -> joiner state transfer over gloo between two threads of this process.

TorchTitan's containers are stood in for by tiny objects with the attributes
transfer.py reads (``.optimizers``, ``.schedulers``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from titan_recover.control import protocol, transport
from titan_recover.rank import transfer
from titan_recover.rank.collectives import CollectiveAborted, ReplicateProcessGroups
from titan_recover.rank.transfer import RNG, TransferError, check_manifest, manifest, pack, unpack


class Optimizers:
    """Stand-in for TorchTitan's OptimizersContainer."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = list(optimizers)


class Schedulers:
    """Stand-in for TorchTitan's LRSchedulersContainer."""

    def __init__(self, *schedulers: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.schedulers = list(schedulers)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def make_model(hidden: int = 8, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def make_trainer(hidden: int = 8, seed: int = 0, steps: int = 0) -> tuple[torch.nn.Sequential, Optimizers, Schedulers]:
    """A model, AdamW and a LambdaLR warmup, optimizer (and scheduler) stepped ``steps`` times."""
    model = make_model(hidden, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    for i in range(steps):
        opt.zero_grad()
        model(torch.full((2, 4), float(i + 1))).square().sum().backward()
        opt.step()
        sched.step()
    return model, Optimizers(opt), Schedulers(sched)


@pytest.fixture(autouse=True)
def _keep_rng() -> Iterator[None]:
    # a receive sets this process's RNG state to the donor's
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


# --- pack / unpack ---------------------------------------------------------------


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    """Odd byte sizes first, so later tensors start at offsets their dtype cannot view."""
    torch.manual_seed(1)
    return [
        ("u8", torch.tensor([1, 2, 255], dtype=torch.uint8)),  # 3 bytes: next offset 3
        ("f32", torch.randn(2, 3)),  # offset 3: misaligned
        ("bf16", torch.randn(3).to(torch.bfloat16)),  # offset 27: misaligned
        ("i64", torch.tensor(-1234567890123, dtype=torch.int64)),  # 0-dim, offset 33: misaligned
        ("u8b", torch.tensor([7], dtype=torch.uint8)),  # offset 41
        ("special", torch.tensor([float("nan"), float("inf"), -0.0, 1e-45])),  # offset 42: misaligned
        ("empty", torch.empty(0, 5)),  # no bytes at offset 58
        ("aligned_i64", torch.arange(3, dtype=torch.int64)),  # offset 58: misaligned
    ]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.unit
def test_pack_is_the_bytes_in_order() -> None:
    tensors = mixed_tensors()
    payload = pack(tensors)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == sum(t.numel() * t.element_size() for _, t in tensors) == 82
    assert torch.equal(payload, torch.cat([as_bytes(t) for _, t in tensors]))


@pytest.mark.unit
def test_pack_unpack_round_trip_is_bit_exact() -> None:
    src = mixed_tensors()
    dst = [(name, torch.zeros_like(t)) for name, t in src]
    unpack(pack(src), dst)
    for (name, a), (_, b) in zip(src, dst):
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert torch.equal(as_bytes(a), as_bytes(b)), name  # bytes: NaN and -0.0 included


@pytest.mark.unit
def test_unpack_writes_in_place() -> None:
    src = mixed_tensors()
    dst = [(name, torch.zeros_like(t)) for name, t in src]
    ptrs = [t.data_ptr() for _, t in dst]
    unpack(pack(src), dst)
    assert [t.data_ptr() for _, t in dst] == ptrs


@pytest.mark.unit
def test_pack_non_contiguous_in_logical_order() -> None:
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    src = [("odd", torch.tensor([1], dtype=torch.uint8)), ("t", base.t())]
    assert not src[1][1].is_contiguous()
    dst = [("odd", torch.zeros(1, dtype=torch.uint8)), ("t", torch.zeros(3, 2))]
    unpack(pack(src), dst)
    assert torch.equal(dst[1][1], base.t())


@pytest.mark.unit
def test_unpack_into_parameters_does_not_track_grad() -> None:
    lin = torch.nn.Linear(3, 2)
    src = [("w", torch.ones(2, 3)), ("b", torch.full((2,), 2.0))]
    unpack(pack(src), [("w", lin.weight), ("b", lin.bias)])
    assert torch.equal(lin.weight.detach(), torch.ones(2, 3))
    assert torch.equal(lin.bias.detach(), torch.full((2,), 2.0))
    assert lin.weight.grad_fn is None and lin.weight.requires_grad


# --- checksum --------------------------------------------------------------------


def reference_checksum(payload: torch.Tensor) -> int:
    """The checksum's definition in plain Python: sum of (2i + 1) * word i, mod 2**64, signed."""
    raw = payload.numpy().tobytes()
    raw += bytes(-len(raw) % 8)  # the last word is zero-padded
    total = sum((2 * i + 1) * int.from_bytes(raw[8 * i : 8 * i + 8], "little") for i in range(len(raw) // 8))
    total %= 1 << 64
    return total - (1 << 64) if total >= 1 << 63 else total


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.unit
@pytest.mark.parametrize("n", [0, 5, 8, 61, 4096 + 3])
def test_checksum_is_its_definition_in_any_chunking(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    payload = random_bytes(n)
    expected = reference_checksum(payload)
    assert transfer.checksum(payload) == expected
    monkeypatch.setattr(transfer, "CHECKSUM_CHUNK", 3)  # many passes, the last one short
    assert transfer.checksum(payload) == expected


@pytest.mark.unit
def test_equal_payloads_have_equal_checksums() -> None:
    payload = random_bytes(1000, seed=1)
    assert (
        transfer.checksum(payload)
        == transfer.checksum(payload.clone())
        == transfer.checksum(random_bytes(1000, seed=1))
    )
    assert transfer.checksum(pack(mixed_tensors())) == transfer.checksum(pack(mixed_tensors()))


@pytest.mark.unit
def test_a_flipped_byte_anywhere_changes_the_checksum() -> None:
    payload = random_bytes(8 * 9 + 5, seed=2)  # a zero-padded last word too
    good = transfer.checksum(payload)
    for i in range(payload.numel()):
        for mask in (0x01, 0x80, 0xFF):
            bad = payload.clone()
            bad[i] ^= mask
            assert transfer.checksum(bad) != good, (i, mask)


@pytest.mark.unit
def test_moved_words_change_the_checksum() -> None:
    payload = random_bytes(64, seed=3)
    swapped = payload.view(torch.int64)[[1, 0, *range(2, 8)]].view(torch.uint8)
    assert transfer.checksum(swapped) != transfer.checksum(payload)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_checksum_on_the_gpu_equals_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    payload = random_bytes((3 << 20) + 7, seed=4)
    assert transfer.checksum(payload.cuda()) == transfer.checksum(payload)
    monkeypatch.setattr(transfer, "CHECKSUM_CHUNK", 1000)
    assert transfer.checksum(payload.cuda()) == transfer.checksum(payload)


# --- manifest / check_manifest ---------------------------------------------------


@pytest.mark.unit
def test_manifest_names_dtype_and_shape() -> None:
    assert manifest(
        [
            ("a", torch.zeros(2, 3)),
            ("b", torch.zeros((), dtype=torch.int64)),
            ("c", torch.zeros(4, dtype=torch.bfloat16)),
        ]
    ) == [
        ["a", "float32", [2, 3]],
        ["b", "int64", []],
        ["c", "bfloat16", [4]],
    ]


@pytest.mark.unit
def test_manifest_survives_json() -> None:
    ours = manifest(mixed_tensors())
    check_manifest(json.loads(json.dumps(ours)), ours)


OURS = [["model0/w", "float32", [8, 4]], ["model0/b", "float32", [8]], [RNG, "uint8", [5056]]]


@pytest.mark.unit
@pytest.mark.parametrize(
    "theirs, fragments",
    [
        (OURS[:2], ["the donor sent 2 tensors, this rank has 3"]),
        (OURS + [["extra", "float32", [1]]], ["the donor sent 4 tensors, this rank has 3"]),
        ([], ["the donor sent 0 tensors, this rank has 3"]),
        ("not a list", ["manifest is not a list", "'not a list'"]),
        (None, ["manifest is not a list", "None"]),
        (
            [OURS[0], ["model0/b", "float32", [9]], OURS[2]],
            ["['model0/b', 'float32', [9]]", "['model0/b', 'float32', [8]]"],
        ),
        (
            [["model0/w", "bfloat16", [8, 4]], *OURS[1:]],
            ["['model0/w', 'bfloat16', [8, 4]]", "['model0/w', 'float32', [8, 4]]"],
        ),
        ([["model0/weight", "float32", [8, 4]], *OURS[1:]], ["'model0/weight'", "'model0/w'"]),
    ],
)
def test_check_manifest_names_the_mismatch(theirs: object, fragments: list[str]) -> None:
    with pytest.raises(TransferError) as info:
        check_manifest(theirs, OURS)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


@pytest.mark.unit
def test_check_manifest_names_the_first_difference() -> None:
    theirs = [["model0/w", "float32", [8, 5]], ["model0/b", "int64", [8]], OURS[2]]
    with pytest.raises(TransferError, match=r"\[8, 5\]") as info:
        check_manifest(theirs, OURS)
    assert "int64" not in str(info.value)


@pytest.mark.unit
def test_check_manifest_accepts_equal() -> None:
    check_manifest([list(e) for e in OURS], OURS)


# --- state_tensors / meta / restore ----------------------------------------------


@pytest.mark.unit
def test_state_tensors_lists_params_then_optimizer_state_then_rng() -> None:
    model, opts, _ = make_trainer(steps=1)
    names = [name for name, _ in transfer.state_tensors([model], opts)]
    assert names[:4] == ["model0/0.weight", "model0/0.bias", "model0/2.weight", "model0/2.bias"]
    assert names[4:7] == ["optim0/g0/p0/exp_avg", "optim0/g0/p0/exp_avg_sq", "optim0/g0/p0/step"]
    assert len(names) == 4 + 4 * 3 + 1
    assert names[-1] == RNG


@pytest.mark.unit
def test_state_tensors_of_a_fresh_optimizer_are_params_and_rng() -> None:
    model, opts, _ = make_trainer(steps=0)
    assert [name for name, _ in transfer.state_tensors([model], opts)][4:] == [RNG]


@pytest.mark.unit
def test_state_bytes_counts_the_moments_a_fresh_adamw_will_make() -> None:
    fresh, fresh_opts, _ = make_trainer(steps=0)
    stepped, opts, _ = make_trainer(steps=1)
    measured = sum(t.numel() * t.element_size() for _, t in transfer.state_tensors([stepped], opts))
    steps = 4 * len(list(stepped.parameters()))  # AdamW's float32 step per parameter: the estimate leaves it out
    assert transfer.state_bytes([fresh], fresh_opts) == measured - steps
    assert transfer.state_bytes([stepped], opts) == measured  # moments it holds are counted once


@pytest.mark.unit
def test_meta_restore_round_trip_through_json() -> None:
    _, d_opts, d_scheds = make_trainer(steps=2)
    _, j_opts, j_scheds = make_trainer(steps=0)
    (d_opt,), (j_opt,) = d_opts.optimizers, j_opts.optimizers
    (d_sched,), (j_sched,) = d_scheds.schedulers, j_scheds.schedulers
    assert j_opt.param_groups[0]["lr"] != d_opt.param_groups[0]["lr"]

    header = transfer.meta({"step": 2, "base_epoch": 3, "ntokens_seen": 99}, d_opts, d_scheds)
    assert (header["step"], header["base_epoch"], header["ntokens_seen"]) == (2, 3, 99)
    group = header["param_groups"][0][0]
    assert "params" not in group and "betas" not in group  # only scalar hyperparameters
    assert group["lr"] == d_opt.param_groups[0]["lr"] and group["weight_decay"] == 0.1

    transfer.restore(json.loads(json.dumps(header)), j_opts, j_scheds)
    assert j_opt.param_groups[0]["lr"] == d_opt.param_groups[0]["lr"]
    assert j_opt.param_groups[0]["initial_lr"] == d_opt.param_groups[0]["initial_lr"]
    assert j_sched.state_dict() == d_sched.state_dict()
    assert j_sched.get_last_lr() == d_sched.get_last_lr()
    assert [p.shape for p in j_opt.param_groups[0]["params"]] == [p.shape for p in d_opt.param_groups[0]["params"]]
    assert j_opt.param_groups[0]["params"][0] is not d_opt.param_groups[0]["params"][0]
    # the schedule goes on from the same place on both
    for _ in range(3):
        d_opt.step(), j_opt.step()
        d_sched.step()
        j_sched.step()
        assert j_opt.param_groups[0]["lr"] == d_opt.param_groups[0]["lr"]


@pytest.mark.unit
def test_restore_rejects_a_different_number_of_schedulers() -> None:
    _, d_opts, d_scheds = make_trainer(steps=1)
    _, j_opts, _ = make_trainer()
    header = transfer.meta({}, d_opts, d_scheds)
    with pytest.raises(ValueError):
        transfer.restore(header, j_opts, Schedulers())


# --- send / receive over a real gloo pair ------------------------------------------


@pytest.fixture
def address() -> Iterator[str]:
    """A fresh store per test: every transfer rendezvous is under the same prefix."""
    port = transport.free_port()
    server = transport.serve(port, 30)
    yield f"127.0.0.1:{port}"
    del server


def run_both(donor: Callable[[], Any], joiner: Callable[[], Any], timeout_s: float = 20.0) -> dict[str, Any]:
    """Runs the two sides in daemon threads; returns each side's result or exception."""
    results: dict[str, Any] = {}

    def wrap(name: str, fn: Callable[[], Any]) -> None:
        try:
            results[name] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            results[name] = e

    threads = [
        threading.Thread(target=wrap, args=(name, fn), daemon=True, name=f"transfer-{name}")
        for name, fn in (("donor", donor), ("joiner", joiner))
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"transfer threads still running: {results}"
    return results


def groups(address: str, replica: int) -> ReplicateProcessGroups:
    return ReplicateProcessGroups(transport.connect(address, 30), replica, group_rank=0, timeout_s=30)


def never() -> bool:
    return False


def test_send_receive_hands_the_joiner_the_donors_state(address: str) -> None:
    d_model, d_opts, d_scheds = make_trainer(seed=0, steps=2)
    j_model, j_opts, j_scheds = make_trainer(seed=1, steps=0)  # a restarted rank: fresh, other init
    d_first, j_first = d_model[0], j_model[0]
    assert isinstance(d_first, torch.nn.Linear) and isinstance(j_first, torch.nn.Linear)
    assert not torch.equal(d_first.weight, j_first.weight)
    assert not j_opts.optimizers[0].state
    d_before = {k: v.clone() for k, v in d_model.state_dict().items()}
    torch.manual_seed(42)
    rng_at_send = torch.get_rng_state()
    calls: list[object] = []

    def donor() -> int:
        g = groups(address, 0)
        with g.pair(epoch=1, joiner=1, donor=True, abort=never) as pair:
            header = transfer.meta({"step": 7, "base_epoch": 1, "ntokens_seen": 4096}, d_opts, d_scheds)
            return transfer.send(
                g, pair, header, [d_model], d_opts, abort=never, after_header=lambda: calls.append("donor")
            )

    def joiner() -> tuple[dict[str, Any], int]:
        g = groups(address, 1)

        def after_header(h: dict[str, Any]) -> None:
            calls.append(("joiner", h["step"]))
            torch.rand(100)  # moves the RNG on: the transfer must set it back to the donor's

        with g.pair(epoch=1, joiner=1, donor=False, abort=never) as pair:
            return transfer.receive(g, pair, [j_model], j_opts, abort=never, after_header=after_header)

    results = run_both(donor, joiner)
    for side in ("donor", "joiner"):
        assert not isinstance(results[side], BaseException), f"{side}: {results[side]!r}"
    sent = results["donor"]
    header, received = results["joiner"]

    # byte counts agree with each other and with the state
    expected = sum(t.numel() * t.element_size() for _, t in transfer.state_tensors([d_model], d_opts))
    assert sent == received == expected
    assert sorted(map(str, calls)) == sorted(map(str, ["donor", ("joiner", 7)]))

    # the header carries what the donor put in it
    assert (header["step"], header["base_epoch"], header["ntokens_seen"]) == (7, 1, 4096)
    assert header["lr_schedulers"] == json.loads(json.dumps([d_scheds.schedulers[0].state_dict()]))
    assert header["param_groups"][0][0]["lr"] == d_opts.optimizers[0].param_groups[0]["lr"]
    assert header["tensors"] == manifest(transfer.state_tensors([d_model], d_opts))

    # parameters and optimizer state are the donor's, bit for bit
    for (name, a), (_, b) in zip(d_model.state_dict().items(), j_model.state_dict().items()):
        assert torch.equal(a, b), name
    d_opt, j_opt = d_opts.optimizers[0], j_opts.optimizers[0]
    d_params, j_params = d_opt.param_groups[0]["params"], j_opt.param_groups[0]["params"]
    for i, (dp, jp) in enumerate(zip(d_params, j_params)):
        assert sorted(j_opt.state[jp]) == sorted(d_opt.state[dp]) == ["exp_avg", "exp_avg_sq", "step"]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(j_opt.state[jp][key], d_opt.state[dp][key]), (i, key)
        assert jp.grad is None  # the state initialization left no gradients behind
    assert torch.equal(torch.get_rng_state(), rng_at_send)

    # the donor's own state is untouched
    for name, v in d_model.state_dict().items():
        assert torch.equal(v, d_before[name]), name

    # restore() applies the rest; then both train on identically
    transfer.restore(header, j_opts, j_scheds)
    assert j_opt.param_groups[0]["lr"] == d_opt.param_groups[0]["lr"]
    assert j_scheds.schedulers[0].state_dict() == d_scheds.schedulers[0].state_dict()
    for model, opt, sched in ((d_model, d_opt, d_scheds.schedulers[0]), (j_model, j_opt, j_scheds.schedulers[0])):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        sched.step()
    for (name, a), (_, b) in zip(d_model.state_dict().items(), j_model.state_dict().items()):
        assert torch.equal(a, b), name


def test_send_receive_without_optimizer_state(address: str) -> None:
    """A donor that never stepped: parameters only; the joiner's optimizer stays empty."""
    d_model, d_opts, _ = make_trainer(seed=0, steps=0)
    j_model, j_opts, _ = make_trainer(seed=1, steps=0)

    def donor() -> int:
        g = groups(address, 0)
        with g.pair(epoch=1, joiner=1, donor=True, abort=never) as pair:
            return transfer.send(g, pair, {"step": 0}, [d_model], d_opts, abort=never, after_header=lambda: None)

    def joiner() -> tuple[dict[str, Any], int]:
        g = groups(address, 1)
        with g.pair(epoch=1, joiner=1, donor=False, abort=never) as pair:
            return transfer.receive(g, pair, [j_model], j_opts, abort=never, after_header=lambda h: None)

    results = run_both(donor, joiner)
    assert not isinstance(results["donor"], BaseException), repr(results["donor"])
    assert not isinstance(results["joiner"], BaseException), repr(results["joiner"])
    assert results["donor"] == results["joiner"][1]
    assert not j_opts.optimizers[0].state
    for (name, a), (_, b) in zip(d_model.state_dict().items(), j_model.state_dict().items()):
        assert torch.equal(a, b), name


def test_receive_rejects_a_different_model_and_the_donor_aborts(address: str) -> None:
    d_model, d_opts, _ = make_trainer(hidden=8, steps=1)
    j_model, j_opts, _ = make_trainer(hidden=9, steps=0)
    j_before = {k: v.clone() for k, v in j_model.state_dict().items()}
    joiner_failed = threading.Event()
    payload_reached: list[bool] = []

    def donor() -> int:
        g = groups(address, 0)
        with g.pair(epoch=1, joiner=1, donor=True, abort=never) as pair:
            return transfer.send(
                g,
                pair,
                {"step": 3},
                [d_model],
                d_opts,
                # the joiner's refusal may land before gloo marks the donor's header sent; the abort
                # this test is about is the one that frees a donor blocked on the payload
                abort=lambda: joiner_failed.is_set() and bool(payload_reached),
                after_header=lambda: payload_reached.append(True),
            )

    def joiner() -> tuple[dict[str, Any], int]:
        g = groups(address, 1)
        with g.pair(epoch=1, joiner=1, donor=False, abort=never) as pair:
            try:
                return transfer.receive(g, pair, [j_model], j_opts, abort=never, after_header=lambda h: None)
            finally:
                joiner_failed.set()

    results = run_both(donor, joiner)
    err = results["joiner"]
    assert isinstance(err, TransferError), repr(err)
    assert "model0/0.weight" in str(err)
    assert "[8, 4]" in str(err) and "[9, 4]" in str(err)
    assert isinstance(results["donor"], CollectiveAborted), repr(results["donor"])
    assert payload_reached == [True]  # it blocked on the payload, after the header
    # the joiner took no byte of the donor's state
    for name, v in j_model.state_dict().items():
        assert torch.equal(v, j_before[name]), name


def test_receive_refuses_a_payload_corrupted_on_the_way(address: str) -> None:
    d_model, d_opts, _ = make_trainer(seed=0, steps=1)
    j_model, j_opts, _ = make_trainer(seed=1, steps=0)
    j_before = {k: v.clone() for k, v in j_model.state_dict().items()}

    def donor() -> int:
        g = groups(address, 0)
        broadcast, sent = g.broadcast, []

        def corrupting(group: Any, tensor: torch.Tensor, abort: Callable[[], bool]) -> None:
            sent.append(tensor)
            if len(sent) == 3:  # the payload: one bit flips on the wire
                tensor = tensor.clone()
                tensor[tensor.numel() // 2] ^= 0x10
            broadcast(group, tensor, abort)

        g.broadcast = corrupting  # type: ignore[method-assign]  # this donor's wire flips a bit of the payload
        with g.pair(epoch=1, joiner=1, donor=True, abort=never) as pair:
            return transfer.send(g, pair, {"step": 2}, [d_model], d_opts, abort=never, after_header=lambda: None)

    def joiner() -> tuple[dict[str, Any], int]:
        g = groups(address, 1)
        with g.pair(epoch=1, joiner=1, donor=False, abort=never) as pair:
            return transfer.receive(g, pair, [j_model], j_opts, abort=never, after_header=lambda h: None)

    results = run_both(donor, joiner)
    assert isinstance(results["donor"], int), repr(results["donor"])
    err = results["joiner"]
    assert isinstance(err, protocol.MessageError), repr(err)
    assert "state transfer payload is corrupt" in str(err) and "checksum" in str(err)
    for name, v in j_model.state_dict().items():  # the joiner took no byte of it
        assert torch.equal(v, j_before[name]), name


def test_a_pair_is_its_own_two_rank_group(address: str) -> None:
    def side(replica: int) -> Callable[[], tuple[int, int]]:
        def run() -> tuple[int, int]:
            with groups(address, replica).pair(epoch=3, joiner=1, donor=replica == 0, abort=never) as pair:
                assert isinstance(pair, dist.ProcessGroupGloo)
                return pair.rank(), pair.size()

        return run

    results = run_both(side(0), side(1))
    assert results == {"donor": (0, 2), "joiner": (1, 2)}
