# What scripts/bench-vs-llamacpp.sh and scripts/fidelity.sh share: llama.cpp's own tools
# built natively from source, and the models they compare on. Sourced from the repository
# root; sets troupe, threads, llamacpp, scale and bin, and defines `build_llamacpp` and
# `default_models` (which appends to the array `models`).
#
# llama.cpp: the tree inside PyPI's llama-cpp-python sdist, configured as its own project
# with the CPU's native instructions, cached in $TROUPE_LLAMACPP_DIR (default
# ~/.cache/troupe/llamacpp). Models: SmolLM2-135M (Q4_1, as fetched, and F16) and
# random-weight models at Llama-3.2-1B's shape (../shared/tools/make-scale-gguf.py writes
# the F16 file, llama-quantize the Q4_K_M, Q4_0, Q8_0 and BF16 copies), cached in
# $TROUPE_SCALE_DIR (~/.cache/troupe/scale); TROUPE_SCALE_SHAPES="llama-1b llama-8b" adds
# the 8B shape (16 GB as F16; its Q4_K_M and Q8_0 copies).

troupe=${TROUPE_BIN:-build/troupe}
threads=$(nproc)
llamacpp=${TROUPE_LLAMACPP_DIR:-$HOME/.cache/troupe/llamacpp}
scale=${TROUPE_SCALE_DIR:-$HOME/.cache/troupe/scale}
bin=$llamacpp/build/bin

build_llamacpp() {
  # On a CPU with AMX, llama.cpp's AMX kernels (tinygemm_kernel_amx) die of SIGILL on some
  # machines (this 2-core VM among them; troupe's own AMX kernel runs there): a prefill of
  # SmolLM2 is tried once, and where it dies llama.cpp is built again without AMX.
  if [ -x "$llamacpp/build-noamx/bin/llama-bench" ]; then
    bin=$llamacpp/build-noamx/bin
    return 0
  fi
  build_llamacpp_in build ""
  local model
  model=$(bash scripts/fetch-smollm2.sh)
  if ! "$bin/llama-bench" -m "$model" -t 1 -r 1 -p 64 -n 0 > /dev/null 2>&1; then
    echo "llama.cpp's prefill died on this CPU (AMX): building it without AMX" >&2
    build_llamacpp_in build-noamx "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    bin=$llamacpp/build-noamx/bin
  fi
}

build_llamacpp_in() { # folder, extra compiler flags
  local tools="llama-bench llama-quantize llama-batched-bench llama-simple llama-perplexity"
  local missing=0 tool
  for tool in $tools; do
    [ -x "$llamacpp/$1/bin/$tool" ] || missing=1
  done
  [ $missing -eq 0 ] && return 0
  echo "building llama.cpp's tools natively in $llamacpp/$1 (minutes)" >&2
  mkdir -p "$llamacpp"
  if ! ls "$llamacpp"/llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt > /dev/null 2>&1; then
    python3 -m pip download --quiet --no-deps --no-binary :all: --dest "$llamacpp" \
      llama-cpp-python >&2
    tar xzf "$(ls "$llamacpp"/llama_cpp_python-*.tar.gz | tail -1)" -C "$llamacpp"
  fi
  local src
  src=$(ls -d "$llamacpp"/llama_cpp_python-*/vendor/llama.cpp | tail -1)
  cmake -S "$src" -B "$llamacpp/$1" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$2" -DCMAKE_CXX_FLAGS="$2" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF > /dev/null
  # shellcheck disable=SC2086
  cmake --build "$llamacpp/$1" -j"$threads" --target $tools > /dev/null
}

default_models() {
  local smollm2 shape f16 types type out
  smollm2=$(bash scripts/fetch-smollm2.sh)
  mkdir -p "$scale"
  # SmolLM2 in F16 too (its Q4_1 weights dequantized by llama-quantize): the 16-bit kernels
  # at a size that sits in the caches.
  out=$scale/smollm2-135m-f16.gguf
  if [ ! -f "$out" ]; then
    "$bin/llama-quantize" --allow-requantize "$smollm2" "$out.part" F16 "$threads" > /dev/null 2>&1
    mv "$out.part" "$out"
  fi
  models+=("$smollm2" "$out")
  for shape in ${TROUPE_SCALE_SHAPES:-llama-1b}; do
    f16=$scale/$shape-f16.gguf
    types="Q4_K_M Q4_0 Q8_0 BF16"
    [ "$shape" = llama-8b ] && types="Q4_K_M Q8_0"
    for type in $types; do
      out=$scale/$shape-${type,,}.gguf
      if [ ! -f "$out" ]; then
        # The F16 file only while a copy is missing: the 8B one is 16 GB, and may be
        # deleted once its copies are made.
        if [ ! -f "$f16" ]; then
          echo "writing $f16 (random weights at $shape's shape)" >&2
          if ! python3 -c "import numpy, gguf" 2> /dev/null; then
            python3 -m pip install --quiet numpy gguf >&2
          fi
          python3 ../shared/tools/make-scale-gguf.py "$f16.part" --shape "$shape" >&2
          mv "$f16.part" "$f16"
        fi
        "$bin/llama-quantize" "$f16" "$out.part" "$type" "$threads" > /dev/null 2>&1
        mv "$out.part" "$out"
      fi
      models+=("$out")
    done
  done
}
