"""Test clusters on one machine: network-namespace nodes, a delay relay, the network-fault scenarios, a local Slurm."""
