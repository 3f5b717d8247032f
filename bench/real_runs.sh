#!/usr/bin/env bash
# The bench runs behind docs/bench/real/ (real checkpoints; every peer beside ours). Each run
# resumes where it stopped (bench run keeps a partial file): run the same line again.
#   bash bench/real_runs.sh smollm2|0.5b|1.5b|1.5b-vllm|profile|profile-peers|lossless|serve|all
#   bash bench/real_runs.sh layouts|draft-probe|speed|speed-int4|speed-vllm   (issue 53: the engine
#   after the speed work, docs/bench/real/speed/)
# Needs: the models pulled (`leapdecode pull NAME`; a run pulls what it lacks), llama.cpp
# (`bash bench/llamacpp_env.sh`) and vLLM (`bash bench/vllm_env.sh`); a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/bench/real
# 2 prompts of each category (completion, revision, grounded, free, chat), 128 new tokens,
# bfloat16 (the pulled folders' own dtype), 2 threads, greedy; every engine's context 4,096
# tokens (the default follows free memory; the longest prompt is under 1,000 tokens)
COMMON=(--per-category 2 --max-new-tokens 128 --threads 2 --dtype bfloat16 --max-model-len 4096)
DRAFTLESS=(--ngram-k 8 --suffix-k 16 --lookahead 3x3x3 --tree-k 16 --peer-ngram-k 8
           --vllm-ngram-k 8 --vllm-suffix-k 16 --llamacpp-ngram-k 64)
OURS_DRAFTLESS=none,ngram,suffix,lookahead
HF_DRAFTLESS=hf-generate,hf-lookup
VLLM_DRAFTLESS=vllm,vllm-ngram,vllm-suffix
LLAMA_DRAFTLESS=llamacpp,llamacpp-ngram,llamacpp-ngram-mod

run() { echo "== leapdecode bench run $*"; leapdecode bench run "$@"; }

smollm2() {
  run --target smollm2-135m-instruct "${COMMON[@]}" "${DRAFTLESS[@]}" --repeats 3 \
    --methods "$OURS_DRAFTLESS,$HF_DRAFTLESS,$VLLM_DRAFTLESS,$LLAMA_DRAFTLESS" \
    --out "$OUT/smollm2-135m"
}
half() {
  run --target qwen2.5-coder-0.5b-instruct "${COMMON[@]}" "${DRAFTLESS[@]}" --repeats 2 \
    --methods "$OURS_DRAFTLESS,$HF_DRAFTLESS,$VLLM_DRAFTLESS,$LLAMA_DRAFTLESS" \
    --out "$OUT/qwen-0.5b"
}
# the pair: ours, transformers and llama.cpp in one run; vLLM in two others (each of its engines
# holds its own copies of the weights, 6-8 GB for the 1.5B: four of them beside ours would
# not fit 24 GiB), each with ours beside it and ours' plain decoding as the common baseline
pair() {
  run --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
    --draft-dtype bfloat16 "${COMMON[@]}" "${DRAFTLESS[@]}" --repeats 2 --draft-k 3 \
    --peer-draft-k 3 --llamacpp-draft-k 3 \
    --methods "none,draft,ngram,suffix,hf-generate,hf-assisted,hf-lookup,llamacpp,llamacpp-draft,llamacpp-ngram,llamacpp-ngram-mod" \
    --out "$OUT/qwen-1.5b-pair"
}
pair_vllm() {
  run --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
    --draft-dtype bfloat16 "${COMMON[@]}" --repeats 2 --draft-k 3 --vllm-draft-k 3 \
    --no-peers --no-llamacpp --methods "none,draft,vllm,vllm-draft" \
    --out "$OUT/qwen-1.5b-pair-vllm"
  run --target qwen2.5-coder-1.5b-instruct "${COMMON[@]}" "${DRAFTLESS[@]}" --repeats 2 \
    --no-peers --no-llamacpp --methods "none,ngram,suffix,vllm-ngram,vllm-suffix" \
    --out "$OUT/qwen-1.5b-vllm-draftless"
}
# the OpenAI server under load: ours (auto among them) against `vllm serve` and llama-server
# (GGUF, its slots), C = 1, 2, 4, 8, 3 rounds; one request a client, 64 tokens (3-4 tokens/s a
# stream on the 1.5B: the defaults would run for hours). Two runs, ours in each: every server
# stays up for its run, and two vLLM servers of the 1.5B (about 8 GB each: its engine keeps a
# second, prepacked copy of the weights) beside ours leave no room for llama.cpp's
serve_pair() {
  local serve=(leapdecode bench serve --target qwen2.5-coder-1.5b-instruct
    --draft qwen2.5-coder-0.5b-instruct --dtype bfloat16 --draft-dtype bfloat16
    --concurrency 1,2,4,8 --rounds 3 --requests-min 2 --requests-per-client 1
    --max-new-tokens 64 --draft-k 3 --ngram-k 8 --suffix-k 16
    --configs none,draft,ngram,suffix,auto)
  echo "== leapdecode bench serve (the pair, against vllm serve)"
  "${serve[@]}" --peer vllm --vllm-configs none,ngram --vllm-ngram-k 8 --out "$OUT/serve-pair-vllm"
  # against llama-server: ours none and auto only (the run above has every fixed one), its
  # plain decoding and n-grams (its draft model lost to its own plain decoding in bench run),
  # so that the run fits half an hour
  echo "== leapdecode bench serve (the pair, against llama-server)"
  "${serve[@]}" --configs none,auto --peer llamacpp --llamacpp-configs none,ngram \
    --llamacpp-precision GGUF --out "$OUT/serve-pair-llamacpp"
}
# ours against transformers in float32 on each run's own prompts (chat included), 128 tokens:
# the bfloat16 runs' differences are then told apart from a fault
lossless() {
  for pair in smollm2-135m-instruct:smollm2-135m qwen2.5-coder-0.5b-instruct:qwen-0.5b; do
    python bench/lossless_real.py --target "${pair%%:*}" --bench-prompts 2 --max-new-tokens 128 \
      --methods none,ngram,suffix,lookahead --out "$OUT/${pair##*:}/lossless_float32" ||
      echo "non-tie differences: see $OUT/${pair##*:}/lossless_float32.md"
  done
  python bench/lossless_real.py --target qwen2.5-coder-1.5b-instruct \
    --draft qwen2.5-coder-0.5b-instruct --bench-prompts 2 --max-new-tokens 128 \
    --methods none,draft,ngram,suffix --out "$OUT/qwen-1.5b-pair/lossless_float32"
}
profile() {
  python bench/step_profile.py --target qwen2.5-coder-1.5b-instruct --rows 1,5,9,17 \
    --context 512 --reps 20 --threads 2 --no-compiled --engine-tokens 48 --llama-bench --vllm \
    --out "$OUT/step_profile_1.5b"
}
# the peers' steps added to the profile above (one whose llama.cpp or vLLM was not built then)
profile_peers() {
  python bench/step_profile.py --target qwen2.5-coder-1.5b-instruct --context 512 --reps 10 \
    --threads 2 --peers-only --vllm --llama-bench --out "$OUT/step_profile_1.5b"
}
# issue 53: the engine after the speed work. The step by layout of the linear layers, both dtypes
layouts() {
  python bench/layout_steps.py --target qwen2.5-coder-1.5b-instruct --dtype bfloat16 --reps 15 \
    --out "$OUT/layout_steps"
  python bench/layout_steps.py --target qwen2.5-coder-1.5b-instruct --dtype float32 --reps 9 \
    --out "$OUT/layout_steps_float32"
}
PAIR=(--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --draft-dtype bfloat16
      "${COMMON[@]}"
      --repeats 2 --draft-k 3 --suffix-k 16 --ngram-k 8)
SPEED=$OUT/speed
# the draft in bfloat16 or int4 (the target bfloat16 either way: the same output), one prompt a
# category: which one the speed runs take (DRAFT_QUANT=int4 bash bench/real_runs.sh speed ...)
draft_probe() {
  for q in none int4; do
    local quant=()
    [ "$q" = none ] || quant=(--draft-quantize "$q")
    run "${PAIR[@]}" --per-category 1 --repeats 1 "${quant[@]}" --no-peers --no-vllm \
      --no-llamacpp --methods none,draft --out "$SPEED/draft-probe-$q"
  done
}
DRAFT_QUANT_ARGS=()
[ -z "${DRAFT_QUANT:-}" ] || DRAFT_QUANT_ARGS=(--draft-quantize "$DRAFT_QUANT")
# ours (auto among them) against llama.cpp at equal precision: the BF16 GGUF of our weights
speed() {
  run "${PAIR[@]}" "${DRAFT_QUANT_ARGS[@]}" --no-peers --no-vllm --llamacpp-precision BF16 \
    --llamacpp-draft-k 3 --llamacpp-ngram-k 64 \
    --methods none,draft,ngram,suffix,auto,llamacpp,llamacpp-draft,llamacpp-ngram,llamacpp-ngram-mod \
    --out "$SPEED/pair-bf16"
}
# int4 ours against llama.cpp's own Q4_K_M file
speed_int4() {
  run "${PAIR[@]}" --quantize int4 --draft-quantize int4 --no-peers --no-vllm \
    --llamacpp-precision GGUF --llamacpp-ngram-k 64 \
    --methods none,draft,ngram,suffix,auto,llamacpp,llamacpp-ngram,llamacpp-ngram-mod \
    --out "$SPEED/pair-int4"
}
# against vLLM: two of its engines at a time fit beside ours (each 7-10 GB for the 1.5B)
speed_vllm() {
  run "${PAIR[@]}" "${DRAFT_QUANT_ARGS[@]}" --no-peers --no-llamacpp --vllm-suffix-k 16 \
    --methods none,suffix,auto,vllm,vllm-suffix --out "$SPEED/pair-vllm-suffix"
  run "${PAIR[@]}" "${DRAFT_QUANT_ARGS[@]}" --no-peers --no-llamacpp --vllm-draft-k 3 \
    --methods none,draft,auto,vllm-draft --out "$SPEED/pair-vllm-draft"
}
case "${1:-all}" in
  smollm2) smollm2 ;;
  0.5b) half ;;
  1.5b) pair ;;
  1.5b-vllm) pair_vllm ;;
  profile) profile ;;
  profile-peers) profile_peers ;;
  lossless) lossless ;;
  serve) serve_pair ;;
  layouts) layouts ;;
  draft-probe) draft_probe ;;
  speed) speed ;;
  speed-int4) speed_int4 ;;
  speed-vllm) speed_vllm ;;
  all) smollm2; half; profile; pair; pair_vllm; lossless; serve_pair ;;
  *) echo "usage: bash bench/real_runs.sh smollm2|0.5b|1.5b|1.5b-vllm|profile|profile-peers|lossless|serve|all|layouts|draft-probe|speed|speed-int4|speed-vllm"
     exit 2 ;;
esac
