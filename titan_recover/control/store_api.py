"""``torch.distributed.Store`` as it is at runtime: the calls torch's stub leaves out or types too narrowly.

torch's ``_distributed_c10d.pyi`` (torch 2.13) has no ``timeout``, ``multi_set`` or ``clone``, and types
values as ``str`` where the C++ side takes bytes too. Every Store has them (TCPStore, PrefixStore, a
Python subclass such as ``EtcdStore``); ``api`` gives a store that type.
"""

from datetime import timedelta
from typing import Protocol, cast

import torch.distributed as dist


class StoreAPI(Protocol):
    """The calls on a store that its stub lacks or types too narrowly."""

    @property
    def timeout(self) -> timedelta: ...

    def set(self, key: str, value: str | bytes) -> None: ...

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes: ...

    def multi_set(self, keys: list[str], values: list[bytes]) -> None: ...

    def clone(self) -> dist.Store: ...


def api(store: dist.Store) -> StoreAPI:
    """``store``, typed with the calls its stub lacks (torch's Store class has them all)."""
    return cast(StoreAPI, store)
