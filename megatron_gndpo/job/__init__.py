"""The job's lifecycle around a run: who owns the run directory (``runlock.py``), the watchdog
that ends a job whose rank went silent and the once-per-job error report (``watchdog.py``), and
what must happen before the watchdog ends a process with ``os._exit`` (``exit.py``).

It sits above ``parallel/`` (the launcher's environment and torch.distributed's start and
shutdown), which never imports it.
"""
