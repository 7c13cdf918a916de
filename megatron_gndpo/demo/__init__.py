"""``megatron-gndpo demo``: distil a tiny reasoning teacher into a student on the CPU.

The pieces: a task with worked solutions (``megatron_gndpo.data.tasks.chains``), a tokenizer
trained on it (``tokenizer``), the teacher and the student start made by supervised fine-tuning
and cached (``models``), greedy held-out accuracy (``evaluate``); the GNDPO / OPD / RLVR
comparison from one student start (``run``) and its report: metrics, plots, ``summary.md``
(``report``).
"""
