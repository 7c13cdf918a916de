"""Making a student from a teacher: depth (and FFN-width) pruning by measured importance.

``megatron-gndpo prune`` (:mod:`megatron_gndpo.prune.cli`) runs :func:`prune_checkpoint`
(``prune/run.py``); the measurements are in ``prune/importance.py``, the weight surgery in
``prune/student.py``. docs/PRUNING.md says how to choose and what was measured.
"""
