"""Optional packages (extras) a config asks for: importable here, or an error naming the extra.

:func:`check_environment` runs where the config will train; ``plan`` (run from a laptop for a
cluster) skips it.
"""

from __future__ import annotations

import importlib.util

from megatron_gndpo.config.loader import ConfigError
from megatron_gndpo.config.schema import Config, teacher_sections


class MissingExtraError(ConfigError):
    """The config asks for an optional package (an extra) that is not installed here."""


def require_package(module: str, *, what: str, extra: str, instead: str) -> None:
    """Raise MissingExtraError naming the extra to install unless ``module`` is importable."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(
            f"{what} needs the Python package {module!r}, which is not installed here: use the "
            f"NGC PyTorch container or `pip install 'megatron-gndpo[{extra}]'` on a CUDA machine; "
            f"or {instead}"
        )


def check_environment(cfg: Config) -> None:
    """Fail clearly when the config asks for an optional package this machine lacks."""
    models = [("model", cfg.model)]
    models += [(f"{key}.model", t.model) for key, t in teacher_sections(cfg)]
    for section, model in models:
        if model.transformer_impl == "transformer_engine" or model.fp8:
            require_package(
                "transformer_engine",
                what=f"{section}.transformer_impl=transformer_engine (or fp8)",
                extra="te",
                instead=f"set {section}.transformer_impl=local (and {section}.fp8=null)",
            )
    if cfg.logging.tensorboard:
        require_package(
            "tensorboard", what="logging.tensorboard=true", extra="tensorboard",
            instead="set logging.tensorboard=false",
        )  # fmt: skip
    if cfg.rollout.engine == "vllm":
        require_package(
            "vllm", what="rollout.engine=vllm", extra="vllm", instead="set rollout.engine=builtin"
        )
