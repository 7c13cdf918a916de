"""The real-model tier: fetching a small pretrained model (``fetch.py``, run by
``scripts/ci/fetch_real_models.sh``) and reading its GGUF file into a Hugging Face directory
(``gguf_to_hf.py``). For that script, the tests and the benchmarks only: no training code imports
it (tests/test_layering.py).
"""
