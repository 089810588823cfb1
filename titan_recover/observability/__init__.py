"""What a run says about itself: the logs, the event log, the end-of-run summary, the status page and its
Prometheus metrics, a process's resources. Imports ``control`` only (the status page reads the store)."""
