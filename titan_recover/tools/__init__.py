"""Tools the benches and tests use beside a run (a local etcd cluster, the goodput model, the test clusters of
``clusters``); never imported by the runtime."""
