"""A run's identity and its sealed view of the control store.

A run is named by its secret and its id (``$TITAN_RECOVER_RUN_ID``). Its keys live under
``run/<tag>/``, the tag a one-way hash of both, so a key name never reveals the secret and
a run with a new id never reads an earlier run's keys. Every value written through a
``SealedStore`` carries an HMAC of its key and bytes under a key derived from the secret:
a client that can reach the store but lacks the secret can delete or flood keys
(availability), never forge a record that a process of the run acts on. Counters
(``add``) and the replicate groups' gloo rendezvous keys (the data plane, which trusts
the network as torch does) pass through unsealed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING

import torch.distributed as dist

from titan_recover.control import keys
from titan_recover.control.protocol import MessageError
from titan_recover.control.store_api import api

if TYPE_CHECKING:
    from titan_recover.control.etcd_store import Changes

MAC_HEX = 32  # 128 bits of HMAC-SHA256, in hex, before the value
REFUSED_LOG_S = 60.0  # a forged key is logged at most once per this
log = logging.getLogger(__name__)


class ForgedRecord(MessageError):
    """A store value that does not carry this run's seal: written by a process without the secret."""


def given_secret(env: os._Environ[str] | dict[str, str] = os.environ) -> str:
    """The run's secret as the user gave it: ``$TITAN_RECOVER_SECRET``, else the first line of the file
    ``$TITAN_RECOVER_SECRET_FILE`` names (``scripts/slurm/train.sbatch`` saves each run's, mode 0600), so a
    joining node or ``python -m titan_recover.drain`` need not have it in a variable; "" for neither. A
    ValueError naming the file when it cannot be read or holds none."""
    if env.get(keys.SECRET_ENV):
        return env[keys.SECRET_ENV]
    path = env.get(keys.SECRET_FILE_ENV, "")
    if not path:
        return ""
    try:
        with open(path) as f:
            secret = f.readline().strip()
    except OSError as e:
        raise ValueError(
            f"{keys.SECRET_FILE_ENV}={path}: cannot read the run's secret ({e.strerror}): name the file that holds "
            f"it (a Slurm job's: outputs/slurm/<job id>/secret in its checkout), or set {keys.SECRET_ENV}"
        ) from None
    if not secret:
        raise ValueError(f"{keys.SECRET_FILE_ENV}={path} holds no secret on its first line: name the run's own file")
    return secret


@dataclass(frozen=True)
class Run:
    """Who a process works for: the run's secret (never stored, printed or put in a key) and its id."""

    secret: str = field(repr=False)
    id: str

    @staticmethod
    def from_env(env: os._Environ[str] | dict[str, str] = os.environ) -> "Run":
        """This process's run, from the environment its launcher sets."""
        secret = env.get(keys.SECRET_ENV, "")
        if not secret:
            raise RuntimeError(
                f"{keys.SECRET_ENV} is not set: start training with run_train.sh, whose launcher makes one per run; "
                "in a multi-node run give every node's launcher the same value"
            )
        return Run(secret, env.get(keys.RUN_ENV, ""))

    def _derive(self, purpose: str) -> bytes:
        return hmac.new(self.secret.encode(), f"titan_recover {purpose} {self.id}".encode(), hashlib.sha256).digest()

    @cached_property
    def public_id(self) -> str:
        """The run's name where anyone may read it (the status page): a one-way hash of secret and
        id that is not the store's ``tag``."""
        return self._derive("public").hex()[:16]

    @cached_property
    def tag(self) -> str:
        """The run's name in the store: a one-way hash of secret and id."""
        return self._derive("tag").hex()[:20]

    @cached_property
    def prefix(self) -> str:
        return f"run/{self.tag}"

    @cached_property
    def _mac_key(self) -> bytes:
        return self._derive("seal")

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._mac_key, key.encode() + b"\0" + value, hashlib.sha256).hexdigest()[:MAC_HEX].encode()

    def seal(self, key: str, value: str | bytes) -> bytes:
        """``value`` as stored under ``key``: its MAC, then its bytes. An empty value stays empty
        (a released claim, as TCPStore's ``compare_set`` understands it)."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        return self._mac(key, data) + data if data else b""

    def unseal(self, key: str, raw: bytes) -> bytes:
        """The value a run's process wrote under ``key``; ``ForgedRecord`` when the seal does not match."""
        if not raw:
            return b""
        mac, data = raw[:MAC_HEX], raw[MAC_HEX:]
        if len(raw) < MAC_HEX or not hmac.compare_digest(mac, self._mac(key, data)):
            raise ForgedRecord(f"store key {key!r} holds a value not sealed with this run's secret: refused")
        return data


def unsealed(key: str) -> bool:
    """Keys whose values pass as they are: the rendezvous of the replicate-dim process groups
    (``SealedStore.process_group_store``)."""
    return key.startswith(keys.PROCESS_GROUPS)


class SealedStore(dist.Store):
    """``inner`` (already under the run's prefix) with every value sealed on write and checked on read."""

    def __init__(self, inner: dist.Store, run: Run) -> None:
        super().__init__()
        self.inner, self.run = inner, run
        self._refused: dict[str, float] = {}
        under = getattr(inner, "underlying_store", None)
        # the etcd store under the run's prefix, where one request does what the TCPStore API needs several for
        self._etcd = under if hasattr(under, "vote") else None
        super().set_timeout(api(inner).timeout)

    def _seal(self, key: str, value: str | bytes) -> bytes:
        if unsealed(key):
            return value.encode() if isinstance(value, str) else bytes(value)
        return self.run.seal(key, value)

    def _unseal(self, key: str, raw: bytes) -> bytes:
        if unsealed(key):
            return bytes(raw)
        try:
            return self.run.unseal(key, bytes(raw))
        except ForgedRecord as e:
            now = time.monotonic()
            if now - self._refused.get(key, -REFUSED_LOG_S) >= REFUSED_LOG_S:
                self._refused[key] = now
                log.warning(f"{e} (a process without the run's secret wrote it)")
            raise

    def _unseal_or_none(self, key: str, raw: bytes) -> bytes | None:
        """``raw`` unsealed, or None when it is forged (logged, never used)."""
        try:
            return self._unseal(key, raw)
        except ForgedRecord:
            return None

    def read(self, key: str) -> bytes | None:
        """The value under ``key``, or None while there is none (or it is forged: logged, never used)."""
        raw = self._read_raw(key)
        return None if raw is None else self._unseal_or_none(key, raw)

    def read_within(self, key: str, seconds: float) -> bytes | None:
        """``read``, waiting up to ``seconds`` for the key to appear: on etcd a watch whose event
        carries the value; on the TCPStore a server-side wait, then a read."""
        if self._etcd is not None:
            raw = self._etcd.get_within(self._full(key), seconds)
        else:
            try:
                self.inner.wait([key], timedelta(seconds=seconds))
            except dist.DistError:
                return None
            raw = self.inner.get(key)
        return None if raw is None else self._unseal_or_none(key, raw)

    def _read_raw(self, key: str) -> bytes | None:
        """One request on etcd (``EtcdStore.read``); the TCPStore API has no read of a key that
        may be missing, so there it is a check then a get."""
        if self._etcd is not None:
            return self._etcd.read(self._full(key))
        return self.inner.get(key) if self.inner.check([key]) else None

    def _full(self, key: str) -> str:
        """``key`` as the store under the run's prefix names it."""
        return f"{self.run.prefix}/{key}"

    # ---- the torch.distributed.Store API --------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        api(self.inner).set(key, self._seal(key, value))

    def get(self, key: str) -> bytes:
        return self._unseal(key, self.inner.get(key))

    def check(self, keys: list[str]) -> bool:
        """Whether every key holds a sealed value: a forged one counts as missing."""
        return (
            all(self.read(k) is not None for k in keys)
            if not all(unsealed(k) for k in keys)
            else self.inner.check(keys)
        )

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values under ``keys``; a forged one reads as empty (and is logged)."""
        out = []
        for key, raw in zip(keys, self.inner.multi_get(keys)):
            try:
                out.append(self._unseal(key, raw))
            except ForgedRecord:
                out.append(b"")
        return out

    def multi_read(self, keys: list[str]) -> list[bytes | None]:
        """The values under ``keys``, None for a missing or forged one: one request on etcd
        (``EtcdStore.read_many``); on the TCPStore one check and one ``multi_get`` while every
        key exists (its ``multi_get`` waits for missing keys)."""
        if self._etcd is not None:
            found = self._etcd.read_many([self._full(k) for k in keys])
            return [None if raw is None else self._unseal_or_none(key, raw) for key, raw in zip(keys, found)]
        if self.inner.check(keys):
            return [raw or None for raw in self.multi_get(keys)]
        return [self.read(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        api(self.inner).multi_set(keys, [self._seal(k, v) for k, v in zip(keys, values)])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """TCPStore's semantics on the sealed values (an empty ``expected``: missing or empty)."""
        got = api(self.inner).compare_set(key, self._seal(key, expected), self._seal(key, desired))
        return self._unseal(key, got)

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    deleteKey = delete_key  # the name torch's C++ side calls

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self.inner.set_timeout(timeout)

    def delete_many(self, keys: list[str], tallies: Sequence[str] = ()) -> None:
        """Deletes ``keys`` and the votes under ``tallies`` (``tally``): one transaction on etcd
        (``EtcdStore.delete``), one call each on the TCPStore."""
        if self._etcd is not None:
            self._etcd.delete([self._full(k) for k in keys], [self._full(f"{c}/") for c in tallies])
            return
        for key in [*keys, *tallies]:
            self.inner.delete_key(key)

    def vote(
        self, counter: str, voter: str, decision: str, expected: int, undecided: str, outcome: str
    ) -> tuple[int, bytes | None]:
        """``voter``'s vote under ``counter``; the votes counted, and ``decision``'s value after the
        vote (None: none yet), which the last of ``expected`` votes sets to ``outcome`` while it still
        holds ``undecided`` (empty: missing), unless another writer was first. On etcd one
        transaction (``EtcdStore.vote``): one Raft write on the commit round's critical path, not a
        vote and then a decision. On the TCPStore, ``add`` and, for the last vote, ``compare_set``."""
        if self._etcd is not None:
            count, raw = self._etcd.vote(
                self._full(f"{counter}/{keys.VOTE_TALLY}"),
                self._full(f"{counter}/{voter}"),
                self._full(decision),
                expected,
                self._seal(decision, undecided),
                self._seal(decision, outcome),
            )
            return count, None if raw is None else self._unseal_or_none(decision, raw)
        count = int(self.inner.add(counter, 1))
        return count, self.compare_set(decision, undecided, outcome) if count == expected else None

    def decide_short(self, counter: str, decision: str, expected: int, undecided: str, outcome: str) -> bytes:
        """Sets ``decision`` to ``outcome`` (an abort) while it holds ``undecided``; on etcd only while
        fewer than ``expected`` votes are under ``counter`` (``EtcdStore.decide_short``). The value
        after the call, as ``compare_set`` answers."""
        if self._etcd is None:
            return self.compare_set(decision, undecided, outcome)
        raw = self._etcd.decide_short(
            self._full(f"{counter}/{keys.VOTE_TALLY}"),
            self._full(decision),
            expected,
            self._seal(decision, undecided),
            self._seal(decision, outcome),
        )
        return self._unseal(decision, raw) if raw is not None else undecided.encode()

    def watch(self, key: str) -> Changes | None:
        """On etcd, a watch of ``key`` (``Changes``: its puts without a request each, ``close`` it);
        None on the TCPStore, which has no watch. For counters, whose values are not sealed."""
        if self._etcd is None:
            return None
        from titan_recover.control.etcd_store import Changes  # the etcd extra: only a run on etcd has it

        return Changes(self._etcd, self._full(key))

    def tallied(self, counter: str) -> int:
        """The votes under ``counter`` so far."""
        if self._etcd is not None:
            return self._etcd.version(self._full(f"{counter}/{keys.VOTE_TALLY}"))
        return int(self.inner.add(counter, 0))

    def delete_under(self, prefixes: tuple[str, ...]) -> None:
        """Deletes every key under ``prefixes`` (names gloo or NCCL chose): the TCPStore lists them;
        etcd deletes the range itself (torch's PrefixStore does not forward a Python store's listing)."""
        if self._etcd is not None:
            self._etcd.delete([], [self._full(prefix) for prefix in prefixes])
            return
        for name in self.inner.list_keys():
            if name.startswith(prefixes):
                self.inner.delete_key(name)

    def key_count(self) -> int | None:
        """How many keys the run has (None where the store cannot list them: etcd)."""
        try:
            return len(self.inner.list_keys())
        except NotImplementedError:
            return None

    def process_group_store(self, prefix: str) -> dist.Store:
        """A connection of its own (``clone``) for a replicate-dim group's rendezvous under ``prefix``
        (a key under ``keys.PROCESS_GROUPS``): C++ only, so no Python object must outlive the call."""
        assert unsealed(prefix), prefix
        return dist.PrefixStore(prefix, api(self.inner).clone())
