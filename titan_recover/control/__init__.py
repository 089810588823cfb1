"""The control plane: what the coordinator, the launchers, their node agents and the ranks say to each other.

Bottom up: ``keys`` and ``protocol`` (pure: key names, one record per message) ->
``addresses`` (pure: host:port and etcd URLs) -> ``store_api`` (torch's Store as it is at runtime) ->
``sealed`` (a run's identity; every value sealed with its secret) -> ``transport`` (TCPStore and etcd: serve,
connect, probe) -> ``client`` (every read and write of a record) -> ``lifeline`` and ``claims`` (a launcher's
threads and claims). Nothing here imports the rank side, the data or TorchTitan.
"""
