"""Tools the benches and tests use beside a run (a local etcd cluster, the goodput model); never imported by the
runtime."""
