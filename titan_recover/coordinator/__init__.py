"""The coordinator process: a pure decision core (``core``) in an I/O shell (``shell``) that reads and
writes the control store. ``python -m titan_recover.coordinator``. It gets its settings from the launcher
as a record (``config.CoordinatorSettings``) and imports no TorchTitan: imports ``control``, ``policy``,
``observability``, ``node`` and ``config``."""
