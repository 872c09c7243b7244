# Sourced by gpu_session.sh and gpu_suite.sh, in the repository root on a device machine:
# the environment every step needs (results under $OUT, NVLink multicast off), then `stage`
# keeps the carried vLLM stage folders in /tmp/vstage, `setup` installs vLLM 0.26 and the
# project's wheels into /tmp/site (once per warm machine), `nccl_only` nccl4py alone.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0

stage() {
  mkdir -p /tmp/vstage && cp -a .stage/p* /tmp/vstage/ && du -sb /tmp/vstage/p*
}

setup() {
  # stage_vllm.sh puts the installer in the last stage folder (with MANIFEST and the extra
  # wheels): carried now, or kept in /tmp/vstage by an earlier call on this machine
  local installer
  installer=$(ls .stage/p*/install_vllm_on_device.sh /tmp/vstage/p*/install_vllm_on_device.sh 2>/dev/null | head -n1)
  [ -n "$installer" ] || { echo "no install_vllm_on_device.sh under .stage/p* or /tmp/vstage/p*: carry the last stage folder" >&2; return 1; }
  # shellcheck disable=SC1090
  . "$installer" || return 1
  if [ ! -f /tmp/site/.refit_installed ]; then
    # .whl carried now, or kept in /tmp/whl by an earlier `wheels` step on this machine
    local whl
    whl=$(ls -d .whl /tmp/whl 2>/dev/null | head -n1)
    [ -n "$whl" ] || { echo "carry .whl with the first setup (or run the wheels step)" >&2; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$whl"/*.whl || return 1
    touch /tmp/site/.refit_installed
  fi
  python3 -c "import refitplane.coordinator, refitplane.generator, vllm, nccl; print('refitplane', refitplane.generator.__file__, 'vllm', vllm.__version__)"
}

nccl_only() {
  # nccl4py alone (no vLLM yet), for the data-plane tests and model_refit
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/nsite .whl/nccl4py*.whl .whl/cuda_pathfinder*.whl || return 1
  # The checkout's core (refitplane/, a namespace portion) and the services' roots.
  export PYTHONPATH=/tmp/nsite:$PWD:$PWD/services/coordinator:$PWD/services/trainer:$PWD/services/generator
}
