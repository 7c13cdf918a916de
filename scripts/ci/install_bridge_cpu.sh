set -x
start=$(date +%s)
/root/.pyenv/versions/3.12.1/bin/python3.12 -m venv /work/main/.venv-bridge
P=/work/main/.venv-bridge/bin/pip
# torch: download.pytorch.org is unreachable here and PyPI's wheel is the CUDA one (GBs); the
# main venv's torch is borrowed instead, through a .pth at the end of sys.path (the packages
# installed below come first, so transformers 5.12.1 shadows the main venv's 5.24).
echo "/work/main/.venv/lib/python3.12/site-packages" > /work/main/.venv-bridge/lib/python3.12/site-packages/zz_main_venv_torch.pth
$P install -q --no-deps megatron-core==0.19.2 megatron-bridge==0.6.2
$P install -q "transformers==5.12.1" einops omegaconf "hydra-core>=1.3.4,<1.4" pyyaml tqdm rich safetensors numpy packaging
# megatron.bridge.training (save_megatron_model) imports these too
$P install -q datasets megatron-energon
t2=$(date +%s); echo "ALL_DONE $((t2-start))s"
du -sh /work/main/.venv-bridge
