"""Checks of a whole config against the rest of the package, run by the entry points before
anything is built: the cross-field rules (:func:`validate`, which asks the configured method for
its own) and the paths it names (:func:`check_paths`). ``config/`` itself imports nothing else
of the package, so every component can read its config without an import circle.
"""

from megatron_gndpo.checks.paths import check_paths
from megatron_gndpo.checks.rules import validate

__all__ = ["check_paths", "validate"]
