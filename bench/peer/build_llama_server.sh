#!/usr/bin/env bash
# Builds llama.cpp's llama-server, the peer that bench.serve compares tokenyard against, llama-perplexity (which
# bench.perplexity_peer compares accuracy with) and llama-quantize (which bench.moe_model uses to write its
# GGUFs) from the llama.cpp sources vendored in the llama-cpp-python
# sdist (so it needs only the pip index and cmake). Those sources also hold convert_hf_to_gguf.py.
#
#   bench/peer/build_llama_server.sh            # -> bench/peer/build/bin/llama-server, llama-perplexity, llama-quantize
#
# Settings (environment): LLAMA_CPP_PYTHON_VERSION (default 0.3.36), PEER_DIR (default bench/peer/build,
# gitignored), PEER_ISA=auto|avx2|avx512 (default auto: AVX-512, VNNI and BF16 only where /proc/cpuinfo
# lists them), JOBS (default nproc), PYTHON (default .venv/bin/python).
#
# The instruction set is chosen explicitly with GGML_NATIVE=OFF and AMX always off: a native or AMX build
# can emit instructions that a virtual machine's CPU reports but does not execute (illegal instruction).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
peer_dir=${PEER_DIR:-$here/build}
isa=${PEER_ISA:-auto}
jobs=${JOBS:-$(nproc)}
python=${PYTHON:-$repo/.venv/bin/python}

cpu_has() { grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -qx "$1"; }

case "$isa" in
  auto)
    avx512=OFF; vnni=OFF; bf16=OFF; vbmi=OFF; avx_vnni=OFF
    if cpu_has avx512f && cpu_has avx512bw && cpu_has avx512vl && cpu_has avx512dq && cpu_has avx512cd; then avx512=ON; fi
    if [ "$avx512" = ON ] && cpu_has avx512_vnni; then vnni=ON; fi
    if [ "$avx512" = ON ] && cpu_has avx512_bf16; then bf16=ON; fi
    if [ "$avx512" = ON ] && cpu_has avx512vbmi; then vbmi=ON; fi
    if cpu_has avx_vnni; then avx_vnni=ON; fi
    ;;
  avx2) avx512=OFF; vnni=OFF; bf16=OFF; vbmi=OFF; avx_vnni=OFF ;;
  avx512) avx512=ON; vnni=ON; bf16=ON; vbmi=ON; avx_vnni=OFF ;;
  *) echo "PEER_ISA must be auto, avx2 or avx512, not '$isa'" >&2; exit 2 ;;
esac
cpu_has avx2 || { echo "this CPU lacks AVX2; the peer build assumes it" >&2; exit 1; }

mkdir -p "$peer_dir"
src_root="$peer_dir/src"
if [ ! -f "$src_root/llama_cpp_python-$version/vendor/llama.cpp/CMakeLists.txt" ]; then
  rm -rf "$src_root" && mkdir -p "$src_root"
  "$python" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$src_root"
  tar xzf "$src_root/llama_cpp_python-$version.tar.gz" -C "$src_root"
fi
llama_src="$src_root/llama_cpp_python-$version/vendor/llama.cpp"

cmake -S "$llama_src" -B "$peer_dir/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF \
  -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX_VNNI=$avx_vnni -DGGML_AVX512=$avx512 -DGGML_AVX512_VNNI=$vnni -DGGML_AVX512_BF16=$bf16 -DGGML_AVX512_VBMI=$vbmi \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
cmake --build "$peer_dir/cmake" --target llama-server llama-quantize llama-perplexity -j "$jobs"

mkdir -p "$peer_dir/bin"
cp "$peer_dir/cmake/bin/llama-server" "$peer_dir/cmake/bin/llama-quantize" "$peer_dir/cmake/bin/llama-perplexity" "$peer_dir/bin/"
ln -sfn "$llama_src" "$peer_dir/llama.cpp"
printf 'llama-cpp-python %s\nAVX2=ON AVX_VNNI=%s AVX512=%s AVX512_VNNI=%s AVX512_BF16=%s AVX512_VBMI=%s AMX=OFF NATIVE=OFF\n' \
  "$version" "$avx_vnni" "$avx512" "$vnni" "$bf16" "$vbmi" > "$peer_dir/bin/BUILD_INFO"
"$peer_dir/bin/llama-server" --version 2>&1 | tail -n 2 >> "$peer_dir/bin/BUILD_INFO" || true
echo "built $peer_dir/bin/llama-server, llama-perplexity and llama-quantize; llama.cpp sources at $peer_dir/llama.cpp"
cat "$peer_dir/bin/BUILD_INFO"
