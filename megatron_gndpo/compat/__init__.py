"""The only place that patches upstream packages. Nothing here runs on import.

``megatron_gndpo.compat.cpu.enable()`` redirects megatron-core's CUDA assumptions (and the few
it makes of Apex/TE norms and NCCL) so that it runs on a CPU with gloo (tests, the embedded demo);
entry points call ``enable_if_no_cuda()``.

``megatron_gndpo.compat.saving.keep_write_results_in_process()`` (called by every checkpoint
save, on any device) keeps megatron-core's write results in a thread queue of the saving rank
instead of a spawned manager process, which outlived a killed rank.

``megatron_gndpo.compat.notices`` collects megatron-core's and torch's known notices (one line
on the console, the notices in the run's log file) instead of printing them on every build.

``megatron_gndpo.compat.safe_pickle.restricted_unpickling()`` (around every checkpoint load,
``checkpoint/dist.py``) makes torch's checkpoint reader unpickle only what a checkpoint is made
of, so a planted pickle runs nothing.
"""
