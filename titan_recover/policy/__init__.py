"""Pure decisions: who is in the run (one decision per membership event), membership and failure verdicts,
the workload policy, the step tally, the restart budget, the fault-plan grammar. No processes, stores or
process groups; imports ``control`` records only."""
