"""Which launcher runs which replica group: claims and incarnation numbers in the coordinator's store.

Each node's launcher claims the groups it was given (``owner/<replica>``, an atomic
compare-and-set) before starting them: two launchers given the same group would
otherwise both run it. A claim whose launcher shows no sign of life (its lifeline
node message ``launcher/<id>`` unchanged for ``stale_s``) is taken over: that is how the same
command, started again on a node whose launcher died, gets that node's groups back.
A live owner's claim is refused.

Incarnation numbers come from the store (``incarnation/<replica>``), not from a
launcher's memory: a replacement launcher's first start of a group that already ran
is incarnation >= 1, so the group asks to rejoin and receives its state from a live peer.
"""

import time
from typing import Callable

from titan_recover.control import keys
from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import Launcher, MessageError

POLL_S = 0.05  # how often a claimant looks at a contested owner's lifeline counter


class ClaimRefused(RuntimeError):
    """Another launcher, alive, already runs some of this launcher's replica groups."""


def silent(
    message_of: Callable[[Launcher], bytes | None], owners: set[Launcher], stale_s: float, unreadable_s: float = 0.0
) -> set[Launcher]:
    """The ``owners`` whose node message (``message_of``) does not change for ``stale_s``: they are
    dead (or cut off for longer than the coordinator's own heartbeat bound). A live one answers
    within one lifeline interval, so a refusal is quick; only a dead owner costs the whole wait.

    A reading of None is none to be had now (on etcd, between two coordinator leaders no board serves the
    node messages): neither a sign of life nor of silence, so an owner's wait starts at its first reading.
    ``ClaimRefused`` when some owner's message could not be read at all within ``stale_s + unreadable_s``."""
    first: dict[Launcher, tuple[bytes, float]] = {}  # each owner's first reading, and when
    waiting, start = set(owners), time.monotonic()
    while True:
        now = time.monotonic()
        for o in list(waiting):
            raw = message_of(o)
            if raw is None:
                continue
            if o not in first:
                first[o] = (raw, now)
            elif raw != first[o][0]:
                waiting.discard(o)  # a sign of life
        unread = [o for o in waiting if o not in first]
        if not unread and all(now - first[o][1] >= stale_s for o in waiting):
            return waiting
        if unread and now - start >= stale_s + unreadable_s:
            raise ClaimRefused(
                f"cannot tell whether {', '.join(map(str, unread))} still runs its replica groups: its node message "
                f"could not be read for {now - start:.0f}s (on etcd: no coordinator leader serves the node board); "
                "start this launcher again once the run has a coordinator"
            )
        time.sleep(POLL_S)


def claim(
    client: ControlClient,
    me: Launcher,
    replicas: list[int],
    stale_s: float,
    log: Callable[[str], None],
    part: int = 0,
    message_of: Callable[[Launcher], bytes | None] | None = None,
    unreadable_s: float = 0.0,
) -> list[int]:
    """Claims ``replicas`` (their part ``part``, when groups span nodes) for ``me``, taking over
    those of launchers silent for ``stale_s`` (by ``message_of``: their node message, from the
    store or, on etcd, the leader's board, None while it cannot be read, for ``unreadable_s`` at most:
    ``silent``); returns the groups taken over.

    Raises ``ClaimRefused`` naming the groups, their live launcher and what to do; the
    claims made here are released then, so the right launcher is not kept waiting.
    """
    try:
        return _claim(client, me, replicas, stale_s, log, part, message_of or client.node_message_raw, unreadable_s)
    except MessageError as e:
        release(client, me, replicas, part)
        raise ClaimRefused(f"cannot tell who runs replica groups {replicas}{_of(part)}: {e}") from None


def _of(part: int) -> str:
    return "" if part == 0 else f" (their part {part})"


def _claim(
    client: ControlClient,
    me: Launcher,
    replicas: list[int],
    stale_s: float,
    log: Callable[[str], None],
    part: int,
    message_of: Callable[[Launcher], bytes | None],
    unreadable_s: float,
) -> list[int]:
    held: dict[int, tuple[bytes, Launcher]] = {}  # claimed by someone else: their exact value, them
    for r in replicas:
        raw = client.store.compare_set(keys.owner_key(r, part), "", me.dumps())
        if raw != me.dumps().encode():
            held[r] = (raw, Launcher.loads(keys.owner_key(r, part), raw))
    owners = {o for _, o in held.values()}
    if owners:
        log(
            f"replica groups {sorted(held)}{_of(part)} are claimed by {', '.join(map(str, owners))}; taking them over "
            f"unless it shows a sign of life within {stale_s:g}s"
        )
    try:
        dead = silent(message_of, owners, stale_s, unreadable_s)
    except ClaimRefused:
        release(client, me, replicas, part)
        raise
    live: dict[int, Launcher] = {}
    for r, (raw, owner) in sorted(held.items()):
        if owner not in dead:
            live[r] = owner
            continue
        got = _take_over(client, me, r, raw, part)
        if got != me.dumps().encode():  # another launcher took it over first
            live[r] = Launcher.loads(keys.owner_key(r, part), got)
    if live:
        release(client, me, replicas, part)
        who = "; ".join(f"{sorted(r for r in live if live[r] == o)} by {o}" for o in dict.fromkeys(live.values()))
        where = keys.REPLICAS_ENV if part == 0 else f"{keys.REPLICAS_ENV} and {keys.GROUP_NODE_ENV}"
        raise ClaimRefused(
            f"replica groups {sorted(live)}{_of(part)} already run under a live launcher ({who}); a replica group "
            f"runs under one launcher per node it spans. Give each node its own groups in {where}; to move groups to "
            "this node, stop that launcher first (its claims are taken "
            f"over once it has shown no sign of life for {stale_s:g}s)"
        )
    taken = sorted(r for r in held if r not in live)
    if dead:
        log(
            f"took over replica groups {taken}{_of(part)} from {', '.join(map(str, dead))}, which shows no sign of life"
        )
    return taken


def claim_free(
    client: ControlClient,
    me: Launcher,
    count: int,
    ids: range,
    members: tuple[int, ...],
    stale_s: float,
    log: Callable[[str], None],
    message_of: Callable[[Launcher], bytes | None],
    unreadable_s: float = 0.0,
) -> list[int]:
    """``count`` replica ids of ``ids`` for a node that asks for any free ones: ids no member of the run
    uses, never claimed first (in order), then ids whose launcher shows no sign of life for ``stale_s`` (a
    group that left or failed with its node); claimed for ``me`` as ``claim`` does.

    Raises ``ClaimRefused`` saying how many were free; what it claimed is released then."""
    mine = me.dumps()
    taken: list[int] = []
    held: dict[int, tuple[bytes, Launcher]] = {}
    try:
        for r in (r for r in ids if r not in members):
            raw = client.store.compare_set(keys.owner_key(r), "", mine)
            if raw == mine.encode():
                taken.append(r)
                if len(taken) == count:
                    return taken
            else:
                held[r] = (raw, Launcher.loads(keys.owner_key(r), raw))
    except MessageError as e:
        release(client, me, taken)
        raise ClaimRefused(f"cannot tell which replica ids are free: {e}") from None
    try:
        dead = silent(message_of, {o for _, o in held.values()}, stale_s, unreadable_s) if held else set()
    except ClaimRefused:
        release(client, me, taken)
        raise
    for r, (raw, owner) in sorted(held.items()):
        if len(taken) < count and owner in dead and _take_over(client, me, r, raw, 0) == mine.encode():
            taken.append(r)
            log(f"took replica id {r} over from {owner}, which shows no sign of life")
    if len(taken) < count:
        release(client, me, taken)
        raise ClaimRefused(
            f"{keys.REPLICAS_ENV} asks for {count} free replica id(s) and {len(taken)} of {ids.start}..{ids.stop - 1} "
            f"are free (members {list(members)}; the others run under live launchers): raise recover.max_replicas "
            "on every node, or start this node once a group has left"
        )
    return sorted(taken)


def _take_over(client: ControlClient, me: Launcher, replica: int, raw: bytes, part: int) -> bytes:
    """Takes the claim on ``replica`` (its part ``part``) over from a silent owner, whose exact claim was
    ``raw``; the claim after it (``me``'s when taken)."""
    got = client.store.compare_set(keys.owner_key(replica, part), raw.decode(), me.dumps())
    if got == b"":  # taken over and released meanwhile by a launcher that was refused
        got = client.store.compare_set(keys.owner_key(replica, part), "", me.dumps())
    return got


def release(client: ControlClient, me: Launcher, replicas: list[int], part: int = 0) -> None:
    """Gives up ``me``'s claims on ``replicas`` (those another launcher holds stay as they are)."""
    for r in replicas:
        client.store.compare_set(keys.owner_key(r, part), me.dumps(), "")


def holds(client: ControlClient, me: Launcher, replica: int, part: int = 0) -> bool:
    """Whether ``me`` still runs ``replica`` (its part ``part``): another launcher takes it over when ``me`` looked
    dead."""
    return client.store.read(keys.owner_key(replica, part)) == me.dumps().encode()
