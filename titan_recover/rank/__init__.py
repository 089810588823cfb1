"""What runs inside a training rank: the protocol client (``manager``), the fault-tolerant replicate
collectives, the state transfer, exact sums, fault injection and the trainers. Imports every layer
below it (``control``, ``policy``, ``observability``, ``node``, ``data``, ``titan``, ``config``), never
``launch`` or ``coordinator``."""
