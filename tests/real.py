"""The real-model tier's model, for the tests marked ``real`` (and the vLLM tier's real-model test).

SmolLM2-135M-Instruct, fetched once by ``scripts/ci/fetch_real_models.sh``
(``megatron_gndpo/real/fetch.py``) into the cache directory the tests read too. Where
it has not been fetched, :func:`real_model_dir` skips the test with a reason that starts with
:data:`ABSENT`; with ``MEGATRON_GNDPO_NO_SKIPS=1`` (CI, which fetches it) ``tests/conftest.py``
turns that skip into a failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gndpo.real.fetch import SMOLLM2_135M, cache_dir, locate

ABSENT = "the real-model tier is absent"


def real_model_dir() -> Path:
    """The fetched Hugging Face directory of SmolLM2-135M-Instruct; skips the test without it."""
    found = locate(SMOLLM2_135M)
    if found is None:
        pytest.skip(
            f"{ABSENT}: SmolLM2-135M-Instruct has not been fetched into {cache_dir()}; fetch it "
            "with pip install -e '.[real]' && scripts/ci/fetch_real_models.sh"
        )
    return found
