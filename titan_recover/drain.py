"""Drains replica groups of a live run for planned maintenance: each leaves at its next step boundary, as
on its node's notice (docs/elasticity.md), and the others take its quota; nothing is computed again.

    TITAN_RECOVER_COORDINATOR=host:port TITAN_RECOVER_SECRET=... python -m titan_recover.drain --replicas 1,3
    TITAN_RECOVER_COORDINATOR=host:port TITAN_RECOVER_SECRET=... python -m titan_recover.drain --node gpu-node-17
    export TITAN_RECOVER_SECRET_FILE=outputs/slurm/1234/secret  # a Slurm job's, saved by its batch script
    python -m titan_recover.drain --coordinator node0:29510 --replicas 1

The run's coordinator address and secret are the ones its other nodes' launchers are given (the secret in
``TITAN_RECOVER_SECRET``, or in the file ``TITAN_RECOVER_SECRET_FILE`` names); the run's id is found from the
secret on the TCPStore (``TITAN_RECOVER_RUN_ID`` names it on etcd). A drained group's launcher exits 4 once all
of its groups left; started again, its groups rejoin from a live peer.
"""

import argparse
import logging
import os
import sys
import time

from titan_recover.control import keys, transport
from titan_recover.control.client import ControlClient
from titan_recover.control.protocol import Drain, Launcher, MessageError
from titan_recover.control.sealed import Run, given_secret
from titan_recover.control.transport import WrongRunError
from titan_recover.observability import logs

CONNECT_S = 30.0
MAX_PARTS = 1024  # a group spans at most this many nodes (each part's launcher claims its own key)
log = logging.getLogger(__name__)


class DrainError(ValueError):
    """The drain cannot be asked: the message names the replica group or setting."""


def parse_ids(text: str) -> list[int]:
    """``1,3`` -> [1, 3]; DrainError naming what is not a replica id."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise DrainError(f"--replicas {text!r}: give replica group ids separated by commas, e.g. 1,3") from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise DrainError(f"--replicas {text!r}: give distinct replica group ids >= 0, e.g. 1,3")
    return ids


def plan(ids: list[int], members: tuple[int, ...], epoch: int, incarnations: dict[int, int]) -> dict[int, int]:
    """The incarnation to drain of each group; DrainError when one is no member, or when no member would be left."""
    missing = [r for r in ids if r not in members]
    if missing:
        raise DrainError(
            f"replica group(s) {missing} are not members of the run's epoch {epoch} (members {list(members)}): "
            "nothing was drained"
        )
    if set(members) <= set(ids):
        raise DrainError(
            f"draining {ids} would leave no replica group of {list(members)}: nothing was drained "
            "(stop the run instead)"
        )
    return {r: incarnations.get(r, 0) for r in ids}


def on_node(node: str, owners: dict[int, list[Launcher]], members: tuple[int, ...]) -> list[int]:
    """The member groups with a part on ``node`` (by its launchers' host names, ``owners``: each group's
    parts' launchers); a group spanning nodes leaves whole. DrainError when none runs there."""
    ids = [r for r in members if any(o.host == node for o in owners.get(r, []))]
    if not ids:
        hosts = {r: sorted({o.host for o in owners.get(r, [])}) for r in members}
        raise DrainError(
            f"--node {node!r}: no replica group of the run's members {list(members)} runs there "
            f"(their nodes: {hosts}): nothing was drained"
        )
    return ids


def owners(client: ControlClient, members: tuple[int, ...]) -> dict[int, list[Launcher]]:
    """Each member group's launchers, part by part, from their claims (a released claim is empty)."""
    found: dict[int, list[Launcher]] = {}
    for r in members:
        for part in range(MAX_PARTS):
            key = keys.owner_key(r, part)
            raw = client.store.read(key)
            if raw is None:
                break
            if raw:
                found.setdefault(r, []).append(Launcher.loads(key, raw))
    return found


def connect(address: str, env: dict[str, str]) -> ControlClient:
    try:
        secret = given_secret(env)
    except ValueError as e:
        raise DrainError(str(e)) from None
    if not secret:
        raise DrainError(
            f"{keys.SECRET_ENV} is not set: give the run's secret, as its other nodes' launchers have it, or "
            f"{keys.SECRET_FILE_ENV}: the file that holds it (a Slurm job's: outputs/slurm/<job id>/secret)"
        )
    run_id = env.get(keys.RUN_ENV) or transport.find_run(address, CONNECT_S, secret).id
    return ControlClient(transport.connect(address, CONNECT_S, Run(secret, run_id)))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m titan_recover.drain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--replicas", help="replica group ids to drain, e.g. 1,3")
    which.add_argument("--node", help="drain every replica group running on this host (its launchers' host name)")
    parser.add_argument("--reason", default="planned maintenance", help="said in the run's log and its left events")
    parser.add_argument("--coordinator", help=f"host:port of the run's coordinator (default: ${keys.COORDINATOR_ENV})")
    args = parser.parse_args(argv)
    logs.setup("drain", __name__)
    address = args.coordinator or os.environ.get(keys.COORDINATOR_ENV, "")
    try:
        ids = parse_ids(args.replicas) if args.replicas is not None else []
        if not address:
            raise DrainError(f"give the run's coordinator: --coordinator host:port or {keys.COORDINATOR_ENV}")
        client = connect(address, dict(os.environ))
        epoch = client.epoch()
        state = client.read_state()
        members = client.membership(epoch).members
        if args.node is not None:
            ids = on_node(args.node, owners(client, members), members)
        drains = plan(ids, members, epoch, state.attempts if state is not None else {})
    except (DrainError, WrongRunError, MessageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return keys.EXIT_BAD_INPUT
    now = time.time()
    for replica, incarnation in drains.items():
        client.drain(replica, Drain(incarnation, args.reason, now))
    log.info(
        f"asked replica group(s) {ids} to leave at their next step boundary ({args.reason}); their launchers act "
        "within a few seconds, and the run's log and events say when each left"
    )
    return keys.EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
