"""The fault-aware data path: microbatches addressed by (step, microbatch, shard), the sample order, the
tokenized corpora on disk and the dataloader any replica can reissue from. ``python -m titan_recover.data``
is its command line. Imports ``control`` (exit codes), ``policy``, ``config`` and ``titan`` (the tokenizer),
nothing of a run's processes."""
