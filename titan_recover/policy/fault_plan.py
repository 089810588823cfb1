"""The ``[recover] fault_plan`` grammar: which failures to inject where. Pure: ``rank.injector`` sends them.

Grammar (whitespace-separated ``key=value`` after an action, entries joined by ``;``)::

    plan   := "none" | entry (";" entry)*
    entry  := ("kill" | "stop" | "sleep" | "corrupt" | "raise" | "slow" | "flip") key=value ...
    keys   := replica=INT   replica group of the rank (required)
              rank=INT      rank inside that group (its shard index; default 0)
              step=INT      training step, 1-based (required, except for join/donate:
                            there it is optional and matches any step); step=+INT
                            counts from the incarnation's first step instead (+1: the
                            first step it computes, as a member or after a job restart),
                            so a kill of a restarted incarnation fires however long its
                            restart took
              phase=NAME    forward | backward | experts | allreduce | optimizer | join
                            | donate (default backward)
              microbatch=INT  which of the replica's microbatches in that step, counted
                            from 0 in the order it computes them (forward/backward/experts only;
                            default 1, or its last one if it has fewer)
              attempt=INT   which incarnation of the replica group (how often the
                            launcher restarted it): default 0, the first; 1 for phase=join
                            (0 there only for a hot spare, whose first incarnation joins)
              seconds=FLOAT how long to sleep (sleep only, required)
              until=epoch   sleep only: wake early, as soon as the coordinator publishes
                            a new epoch (a failure or an admission); ``seconds`` bounds it
              factor=FLOAT  how many times as long each microbatch takes (slow only,
                            required, > 1)
              bit=INT       which bit of the gradient's element flip flips (flip only;
                            default: the dtype's top mantissa bit, 22 in float32)
              repeat=true   flip only: every microbatch from ``step`` on, in every
                            incarnation of the group (a bad device), not just one

Actions: ``kill`` sends SIGKILL to the rank itself, ``stop`` sends SIGSTOP (a hang:
the process and its heartbeat freeze), ``sleep`` makes it slow but alive (with
``until=epoch`` only until membership changes: a survivor held back while a group
restarts resumes the moment that group is admitted, instead of a fixed time), ``corrupt``
flips the sign of the rank's first parameter shard (a silent data corruption: the
replica trains on with parameters that differ from the others'), ``raise`` raises an
exception in the training code (a bug of the job: the same entry on several replicas
stands for a config or code error that every replica meets). ``flip`` flips one bit of the
largest-magnitude element of that microbatch's gradient on that rank, after its backward and
before it is added to the step's sum (a silent data corruption inside the computation: every
replica receives the same wrong sum, so the parameter digests cannot see it); its default bit,
the top mantissa bit, moves the element by at most half its size and keeps it finite. ``slow`` makes a straggler:
from ``step`` on (default: the first), every microbatch of every rank of that replica
group, in every incarnation, takes ``factor`` times as long (it sleeps the difference
after computing), as a slower GPU or a throttled host would. Points:
mid-forward and mid-backward mean inside the middle transformer block of that
microbatch; experts means inside the middle mixture-of-experts layer, as its experts
are called: with expert parallelism, after the tokens were sent to the experts' ranks
and before the outputs come back (a model without one is refused); allreduce means
after the replicate all-reduce was launched; optimizer
means after the step was agreed, before ``optimizer.step()``; join means a restarted
rank in the middle of receiving its state, donate a live rank in the middle of
sending it (after the header, before the tensors).
"""

from dataclasses import dataclass

PHASES = ("forward", "backward", "experts", "allreduce", "optimizer", "join", "donate")
TRANSFER_PHASES = ("join", "donate")  # step is optional for these
ACTIONS = ("kill", "stop", "sleep", "corrupt", "raise", "slow", "flip")
MAX_BIT = 63  # a gradient element's bits: checked against its dtype's width when it fires


class FaultPlanError(ValueError):
    """A fault plan that does not parse; the message names the bad part."""


@dataclass(frozen=True)
class Fault:
    action: str
    replica: int
    step: int | None
    rank: int = 0
    phase: str = "backward"
    microbatch: int = 1
    incarnation: int = 0
    seconds: float = 0.0
    factor: float = 1.0
    until: str = ""  # "epoch": a sleep ends at the next epoch
    bit: int | None = None  # flip: which bit (None: the dtype's top mantissa bit)
    repeat: bool = False  # flip: every microbatch from ``step`` on, in every incarnation
    relative: bool = False  # step=+N: the incarnation's N-th step (see ``at_step``)

    def at_step(self, first: int | None) -> int | None:
        """The training step it fires at, for an incarnation whose first step is ``first`` (None: not known yet)."""
        if not self.relative or self.step is None:
            return self.step
        return None if first is None else first + self.step - 1


def _positive(key: str, value: str, above: float) -> float:
    try:
        number = float(value)
    except ValueError:
        raise FaultPlanError(f"{key} must be a number, got {value!r}") from None
    if not above < number < float("inf"):
        raise FaultPlanError(f"{key} must be finite and > {above:g}, got {value!r}")
    return number


def parse_fault_plan(plan: str) -> tuple[Fault, ...]:
    """Parses a fault plan string into faults; ``"none"`` or ``""`` is no fault."""
    if plan.strip().lower() in ("", "none"):
        return ()
    faults = []
    for entry in plan.split(";"):
        words = entry.split()
        if not words:
            raise FaultPlanError(f"empty entry in fault plan {plan!r}")
        action, args = words[0], words[1:]
        if action not in ACTIONS:
            raise FaultPlanError(f"unknown action {action!r} in {entry.strip()!r}; choose one of {ACTIONS}")
        fields: dict[str, object] = {}
        for arg in args:
            key, sep, value = arg.partition("=")
            if not sep or not value:
                raise FaultPlanError(f"expected key=value, got {arg!r} in {entry.strip()!r}")
            if key == "phase":
                if value not in PHASES:
                    raise FaultPlanError(f"unknown phase {value!r}; choose one of {PHASES}")
                fields[key] = value
            elif key == "seconds":
                fields[key] = _positive(key, value, 0)
            elif key == "until":
                if value != "epoch":
                    raise FaultPlanError(f"until= takes only 'epoch', got {value!r} in {entry.strip()!r}")
                fields[key] = value
            elif key == "factor":
                fields[key] = _positive(key, value, 1)
            elif key == "repeat":
                if value not in ("true", "false"):
                    raise FaultPlanError(f"repeat= takes true or false, got {value!r} in {entry.strip()!r}")
                fields[key] = value == "true"
            elif key in ("replica", "rank", "step", "microbatch", "attempt", "bit"):
                if key == "step" and value.startswith("+"):
                    fields["relative"], value = True, value[1:]
                try:
                    number = int(value)
                except ValueError:
                    raise FaultPlanError(f"{key} must be an integer, got {value!r}") from None
                if number < (1 if key == "step" else 0) or (key == "bit" and number > MAX_BIT):
                    raise FaultPlanError(f"{key} out of range: {number}")
                fields[key] = number
            else:
                raise FaultPlanError(f"unknown key {key!r} in {entry.strip()!r}")
        if action == "slow" and fields.get("relative"):
            raise FaultPlanError(f"slow takes an absolute step= (it slows every incarnation), in {entry.strip()!r}")
        if action == "slow" and (extra := sorted(fields.keys() - {"replica", "step", "factor"})):
            raise FaultPlanError(
                f"slow takes replica=, factor= and step= only (it slows every rank of the "
                f"group, in every incarnation), not {', '.join(extra)}, in {entry.strip()!r}"
            )
        if action == "flip":
            _check_flip(fields, entry.strip())
        phase = fields.setdefault("phase", "backward")
        required = ["replica"] if phase in TRANSFER_PHASES or action == "slow" else ["replica", "step"]
        for key, owner in (
            ("seconds", "sleep"),
            ("until", "sleep"),
            ("factor", "slow"),
            ("bit", "flip"),
            ("repeat", "flip"),
        ):
            if action != owner and key in fields:
                raise FaultPlanError(f"{key}= only goes with {owner}, in {entry.strip()!r}")
        required += {"sleep": ["seconds"], "slow": ["factor"]}.get(action, [])
        for key in required:
            if key not in fields:
                raise FaultPlanError(f"{key}= is required in {entry.strip()!r}")
        if phase == "join":
            fields.setdefault("attempt", 1)  # attempt=0 only for a hot spare (checked against the layout by config)
        fields.setdefault("step", None)
        if "attempt" in fields:  # the plan's key (as users write it) is the Fault's incarnation
            fields["incarnation"] = fields.pop("attempt")
        faults.append(Fault(action=action, **fields))  # type: ignore[arg-type]  # each field was parsed to its type above
    return tuple(faults)


def _check_flip(fields: dict[str, object], entry: str) -> None:
    """A flip fires between a microbatch's backward and its addition to the sum: it has no phase, and a repeated
    one lasts from ``step`` on in every incarnation, on every microbatch, so it names neither."""
    if "phase" in fields:
        raise FaultPlanError(f"flip fires after a microbatch's backward and takes no phase=, in {entry!r}")
    if fields.get("relative"):
        raise FaultPlanError(f"flip takes an absolute step=, in {entry!r}")
    if fields.get("repeat") and (extra := sorted(fields.keys() & {"microbatch", "attempt"})):
        raise FaultPlanError(
            f"flip repeat=true flips every microbatch from step= on, in every incarnation: not {', '.join(extra)}, "
            f"in {entry!r}"
        )
