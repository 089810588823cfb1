"""A node's process plumbing: its agent (the launcher's side of the control plane), the local channel to
its ranks, devices, parent-death signals and stack dumps. Imports ``control``, ``policy``, ``observability``
and ``config``."""
