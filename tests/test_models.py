"""Model builders: specs, optional Transformer Engine, the SDPA core attention."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_gndpo.config import MissingExtraError
from megatron_gndpo.config.schema import ModelConfig, ParallelConfig

pytestmark = [pytest.mark.megatron]

HAS_TE = importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(HAS_TE, reason="Transformer Engine is installed")
@pytest.mark.parametrize(
    "overrides",
    [{"transformer_impl": "transformer_engine"}, {"fp8": "hybrid"}],
    ids=["te-spec", "fp8"],
)
def test_transformer_engine_absent_is_a_clear_error(overrides: dict[str, str]) -> None:
    from megatron_gndpo.models.gpt import layer_spec, transformer_config

    model = ModelConfig(**overrides)  # type: ignore[arg-type]
    with pytest.raises(MissingExtraError, match=r"megatron-gndpo\[te\]") as err:
        transformer_config(model, ParallelConfig())
    assert "transformer_impl=local" in str(err.value)
    if "transformer_impl" in overrides:
        with pytest.raises(MissingExtraError):
            layer_spec(model)


def test_local_spec_uses_sdpa_core_attention_by_default() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_gndpo.models.attention import SDPAttention
    from megatron_gndpo.models.gpt import layer_spec

    core = lambda m: layer_spec(m).submodules.self_attention.submodules.core_attention
    assert core(ModelConfig()) is SDPAttention
    assert core(ModelConfig(core_attention="local")) is DotProductAttention


def _reference_attention(q, k, v, causal_offset):  # [s, b, n, d] inputs, float64
    sq, sk = q.shape[0], k.shape[0]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k) / q.shape[-1] ** 0.5
    allowed = torch.ones(sq, sk, dtype=torch.bool).tril(causal_offset)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bnqk,kbnd->qbnd", scores.softmax(-1), v)
    return out.reshape(sq, q.shape[1], -1)


@pytest.mark.parametrize("sq,sk", [(7, 7), (1, 9), (3, 9)], ids=["prefill", "decode", "chunk"])
def test_sdpa_attention_is_causal_with_gqa_and_kv_cache_shapes(sq: int, sk: int) -> None:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_gndpo.models.attention import SDPAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        attention_dropout=0.0,
    )
    attn = SDPAttention(config, 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sq, 2, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(sk, 2, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(sk, 2, 2, 8, generator=g, dtype=torch.float64)
    out = attn(q, k, v, attention_mask=None)
    # queries are the last sq positions of the sk keys (KV cache): bottom-right causal
    expected = _reference_attention(q, k, v, causal_offset=sk - sq)
    assert out.shape == (sq, 2, 32)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
