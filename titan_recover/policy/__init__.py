"""Pure decisions: membership and failure verdicts, the workload policy, the step tally, the restart
budget, the fault-plan grammar. No processes, stores or process groups; imports ``control`` records only."""
