"""float64 references of the vocab-parallel log-prob tests, and a recorder of what an op allocates.

Shapes: hidden [T, H], weight [V, H] (V rows, padding included), targets [T]. The reference is
``log_softmax(hidden · Wᵀ / τ)`` in float64 with the padding columns at −inf. Shared by
tests/test_logprobs.py and tests/test_logprobs_ext.py.
"""

from __future__ import annotations

import math
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def make_case(
    tokens: int, hidden: int, rows: int, vocab_size: int, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 hidden [T, H], weight [rows, H] and targets [T] < vocab_size (logits of order 1)."""
    gen = torch.Generator().manual_seed(seed)
    hidden_TH = torch.randn(tokens, hidden, generator=gen)
    weight_VH = 2.0 * torch.randn(rows, hidden, generator=gen) / math.sqrt(hidden)
    targets_T = torch.randint(0, vocab_size, (tokens,), generator=gen)
    return hidden_TH, weight_VH, targets_T


def reference_log_softmax(
    hidden_TH: torch.Tensor, weight_VH: torch.Tensor, vocab_size: int, temperature: float
) -> torch.Tensor:
    """float64 log-softmax over the full vocabulary [T, V], padding columns −inf."""
    logits_TV = hidden_TH.double() @ weight_VH.double().t() / temperature
    padding_V = torch.arange(weight_VH.shape[0]) >= vocab_size
    return torch.log_softmax(logits_TV.masked_fill(padding_V, -math.inf), dim=-1)


def reference_logprobs(hidden_TH, weight_VH, targets_T, vocab_size, temperature):
    logp_TV = reference_log_softmax(hidden_TH, weight_VH, vocab_size, temperature)
    return logp_TV.gather(-1, targets_T.unsqueeze(-1)).squeeze(-1)


def reference_grads(hidden_TH, weight_VH, targets_T, grad_T, vocab_size, temperature):
    """float64 gradients of Σ_t grad_t · logp_t w.r.t. hidden and weight, by autograd."""
    hidden64 = hidden_TH.detach().double().requires_grad_()
    weight64 = weight_VH.detach().double().requires_grad_()
    logp_T = reference_logprobs(hidden64, weight64, targets_T, vocab_size, temperature)
    (logp_T * grad_T.double()).sum().backward()
    return hidden64.grad, weight64.grad


def reference_topk(hidden_TH, weight_VH, vocab_size, temperature, k):
    logp_TV = reference_log_softmax(hidden_TH, weight_VH, vocab_size, temperature)
    return logp_TV.topk(k, dim=-1)


def reference_entropy(hidden_TH, weight_VH, vocab_size, temperature):
    logp_TV = reference_log_softmax(hidden_TH, weight_VH, vocab_size, temperature)
    return -torch.special.xlogy(logp_TV.exp(), logp_TV.exp()).sum(-1)


class MemoryRecorder(TorchDispatchMode):
    """Watches every tensor an aten op produces: the largest one, and the peak of live bytes.

    A storage is live while any tensor seen on it is alive (tensors keep their Python object
    while C++ holds them, so a weak reference dies with the tensor itself). Storages of the
    ``existing`` tensors (the inputs) are not counted.
    """

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.holders: dict[int, set[int]] = {}  # storage address -> ids of live tensors on it
        self.nbytes: dict[int, int] = {}
        self.live_bytes = self.peak_bytes = self.largest_numel = 0
        self.ops: Counter[str] = Counter()

    def _release(self, storage: int, tensor_id: int) -> None:
        self.holders[storage].discard(tensor_id)
        if not self.holders[storage]:
            del self.holders[storage]
            self.live_bytes -= self.nbytes.pop(storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func.overloadpacket.__name__] += 1
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            self.largest_numel = max(self.largest_numel, tensor.numel())
            storage = tensor.untyped_storage().data_ptr()
            if storage in self.existing or storage == 0:  # an input, or empty
                continue
            holders = self.holders.setdefault(storage, set())
            if not holders:
                self.nbytes[storage] = tensor.untyped_storage().nbytes()
                self.live_bytes += self.nbytes[storage]
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            if id(tensor) not in holders:
                holders.add(id(tensor))
                weakref.finalize(tensor, self._release, storage, id(tensor))
        return out
