"""The only place that patches upstream packages. Nothing here runs on import.

``megatron_gndpo.compat.cpu.enable()`` redirects megatron-core's CUDA assumptions so that it runs
on a CPU with gloo (tests, the embedded demo); entry points call ``enable_if_no_cuda()``.
"""
