"""``megatron-gndpo compress``: a teacher made into a smaller student and distilled on-policy,
as one resumable command (docs/PRUNING.md, "Compression as one command").

- :mod:`.answers`: the held-out questions and the task score of an answer;
- :mod:`.evaluate`: the held-out measures of any model (task, agreement with the teacher, EOS
  rate, lengths, reverse KL);
- :mod:`.stages`: the recipe's stages (teacher, prune, baseline, warm-up, distill), each
  skipped when its output in OUT is complete;
- :mod:`.report`: ``report.md``, ``curves.jsonl`` and ``curves.png``;
- :mod:`.cli`: the command's options and the checks made before anything is loaded.
"""
