#!/usr/bin/env bash
# llama.cpp built here, for the llama.cpp peers of `leapdecode bench run` / `bench serve`
# (docs/llamacpp.md). PyPI carries llama.cpp's whole source inside the llama-cpp-python sdist
# (vendor/llama.cpp): it is downloaded (sha256 pinned), unpacked and built with cmake.
#   bash bench/llamacpp_env.sh [DIR]    (default: .llamacpp in the repository; about 15 minutes
#                                        on two cores, 300 MB)
# DIR/bin holds llama-server, llama-bench and llama-speculative; DIR/src/vendor/llama.cpp holds
# convert_hf_to_gguf.py (`leapdecode.bench.llamacpp_peer` makes BF16 GGUFs with it).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.llamacpp}"
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
SDIST="$DIR/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  echo "downloading llama-cpp-python $VERSION's source from PyPI (76 MB)"
  # the file itself, from PyPI's simple index (pip download would prepare the sdist's metadata,
  # which needs its build backend); pip download if that fails (a mirror in pip's config)
  "$PY" - "$VERSION" "$SDIST.partial" <<'PYEOF' && mv "$SDIST.partial" "$SDIST" \
    || "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR"
import json, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
name = f"llama_cpp_python-{version}.tar.gz"
try:  # PyPI's simple index (PEP 691, JSON), what pip reads
    req = urllib.request.Request("https://pypi.org/simple/llama-cpp-python/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    url = next(f["url"] for f in files if f["filename"] == name)
    urllib.request.urlretrieve(url, out)
except Exception as e:  # noqa: BLE001 - the shell falls back to pip download
    sys.exit(f"PyPI's index did not give {name} ({e}); trying pip download")
PYEOF
fi
echo "$SHA256  $SDIST" | sha256sum -c --quiet - \
  || { echo "the sdist's sha256 is not the pinned one: delete $SDIST and run again"; rm -f "$SDIST"; exit 1; }
if [ ! -d "$DIR/src/vendor/llama.cpp" ]; then
  rm -rf "$DIR/src" && mkdir -p "$DIR/src"
  tar -xzf "$SDIST" -C "$DIR/src" --strip-components=1
fi
echo "building llama.cpp (cmake, $JOBS jobs; about 15 minutes on two cores)"
cmake -S "$DIR/src/vendor/llama.cpp" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
  > "$DIR/cmake.log" 2>&1 || { tail -30 "$DIR/cmake.log"; exit 1; }
# progress: every 20th "[ NN%]" line; the whole output in build.log, its tail on a failure
cmake --build "$DIR/build" -j "$JOBS" --target llama-server llama-bench llama-speculative \
  > "$DIR/build.log" 2>&1 &
BUILD=$!
tail -n +1 -f --pid "$BUILD" "$DIR/build.log" \
  | { grep --line-buffered -E '^\[ *[0-9]+%\]' || true; } | awk 'NR % 20 == 0 {print; fflush()}'
wait "$BUILD" || { tail -30 "$DIR/build.log"; echo "the build failed: its log is $DIR/build.log"; exit 1; }
mkdir -p "$DIR/bin"
for b in llama-server llama-bench llama-speculative; do
  cp "$DIR/build/bin/$b" "$DIR/bin/$b"
done
# convert_hf_to_gguf.py imports sentencepiece even for BPE tokenizers, and its own gguf-py
"$PY" -m pip install --quiet sentencepiece || echo "note: pip could not install sentencepiece; BF16 GGUFs cannot be made"
"$DIR/bin/llama-server" --version 2>&1 | head -2
echo "llama.cpp ready in $DIR/bin"
