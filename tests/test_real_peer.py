"""The real-model peer's own logic (benchmarks/real_peer.py), on a tiny random transformers Llama:
no real model, no TRL run.

real_distill's ``Evaluator`` measures the peer through two transformers hooks; what must hold:
``generate``'s left-padded output becomes the rollout our generators return (each response cut
after its first stop token, right-padded), the log-probs are ``score_tokens``' layout, the
greedy answers of a batch are each prompt's own, and the whole evaluation of a model against
itself is no divergence and full agreement. The learning run itself is the benchmark's
(``python benchmarks/real_peer.py --steps 2 --eval-interval 1 --seeds 1``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks import real_distill, real_peer
from megatron_gndpo.data.tokenizer import CharTokenizer
from megatron_gndpo.rollout.base import SamplingParams

pytest.importorskip("transformers")

STOP, PAD = 2, 0


def _tiny_llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=CharTokenizer().vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=STOP, pad_token_id=PAD,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_generate_output_becomes_a_right_padded_rollout() -> None:
    prompts = [[5, 6, 7], [8]]
    # left-padded to width 3, 2 samples a prompt; responses of 4 new tokens
    out = torch.tensor([
        [5, 6, 7, 9, STOP, STOP, STOP],  # ends at its first stop; generate's padding is stops
        [5, 6, 7, 9, 10, 11, 12],  # cut at the length limit: not finished
        [PAD, PAD, 8, STOP, STOP, STOP, STOP],  # ends at once
        [PAD, PAD, 8, 13, 14, STOP, 15],  # nothing after the first stop is kept
    ])  # fmt: skip
    r = real_peer.rollout_from(out, 3, prompts, 2, (STOP,), PAD)
    assert r.finished.tolist() == [True, False, True, True]
    assert r.prompt_index.tolist() == [0, 0, 1, 1]
    assert r.prompt_lengths.tolist() == [3, 3, 1, 1]
    assert r.lengths.tolist() == [5, 7, 2, 4]
    assert r.responses() == [[9, STOP], [9, 10, 11, 12], [STOP], [13, 14, STOP]]
    assert r.tokens[2].tolist() == [8, STOP, PAD, PAD, PAD, PAD, PAD]
    assert r.tokens[3].tolist() == [8, 13, 14, STOP, PAD, PAD, PAD]
    # the reverse KL's tokens: each response with its stop token, never a prompt or padding
    assert r.response_mask.sum(1).tolist() == [2, 4, 1, 3]


def test_token_logprobs_are_score_tokens_layout() -> None:
    model = _tiny_llama()
    rows = [[1, 5, 6, 7, 8], [1, 9, 10]]
    tokens = torch.tensor([rows[0], [*rows[1], STOP, STOP]])  # the pad id is the stop id
    lp = real_peer.token_logprobs(model)(tokens, torch.tensor([5, 3]))
    for i, row in enumerate(rows):
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([row])).logits[0].log_softmax(-1)
        want = [0.0] + [float(alone[t - 1, row[t]]) for t in range(1, len(row))]
        assert lp[i, : len(row)].tolist() == pytest.approx(want, abs=1e-5)
        assert lp[i, len(row) :].abs().sum() == 0  # padding scores nothing


def test_batched_greedy_answers_are_each_prompts_own() -> None:
    tok = CharTokenizer()
    model = _tiny_llama(1)
    ids = [tok.apply_chat_template(p) for p in ("a", "a longer question?", "mid one")]
    generator = real_peer.HFGenerator(model, tok.pad_id)
    batch = real_distill.greedy_answers(generator, ids, tok, 12)
    for i, prompt in enumerate(ids):
        alone = real_distill.greedy_answers(generator, [prompt], tok, 12)
        assert real_peer.greedy_mismatches(
            real_distill.Answers(*(x[i : i + 1] for x in (batch.texts, batch.finished,
                                                          batch.lengths))), alone
        ) == []  # fmt: skip
    assert all(n <= 12 for n in batch.lengths)


def test_sampling_is_seeded_and_leaves_the_callers_rng_alone() -> None:
    tok = CharTokenizer()
    generator = real_peer.HFGenerator(_tiny_llama(2), tok.pad_id)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(STOP,),
                            samples_per_prompt=2)  # fmt: skip
    ids = [tok.apply_chat_template("q")]
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    first = generator.generate(ids, params, seeds=[3])
    assert torch.rand(1) == before  # the caller's stream did not move
    second = generator.generate(ids, params, seeds=[3])
    assert torch.equal(first.tokens, second.tokens)
    assert first.prompt_index.tolist() == [0, 0]


def test_a_model_measured_against_itself() -> None:
    tok = CharTokenizer()
    model = _tiny_llama(3)
    questions = [real_distill.Question("Say x.", "x", "repeat"),
                 real_distill.Question("Capital?", "Paris", "capital")]  # fmt: skip
    ids = [tok.apply_chat_template(q.prompt) for q in questions]
    mine = real_distill.greedy_answers(real_peer.HFGenerator(model, tok.pad_id), ids, tok, 10)
    evaluate = real_peer.HFEvaluator(
        tok, questions, mine, max_new_tokens=10, token_budget=0, samples=2, seed=real_distill.SEED
    )
    found = evaluate.measure(model, model)
    assert set(found) == set(real_distill.MEASURES)
    assert found["reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert found["agreement"] == 1.0
    assert found["greedy_length"] == sum(mine.lengths) / 2
    assert 0 < found["sampled_length"] <= 10
