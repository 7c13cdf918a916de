"""The only place that patches upstream packages. Nothing here runs on import.

``megatron_gndpo.compat.cpu.enable()`` redirects megatron-core's CUDA assumptions (and the few
it makes of Apex/TE norms and NCCL) so that it runs on a CPU with gloo (tests, the embedded demo);
entry points call ``enable_if_no_cuda()``.
"""
