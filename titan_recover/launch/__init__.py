"""A node's launcher (``python -m titan_recover.launch``, behind ``run_train.sh``): the coordinator and one
torchrun job per replica group, restarted when it fails. Imports every layer but ``rank`` and ``coordinator``
(it starts those as processes)."""
