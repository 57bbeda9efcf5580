# DeepSeek-V2-Lite-like MoE: 27 layers (first dense), hidden 2048, MLA, 64 routed experts top-6
# plus 2 shared. 27 layers do not split evenly: this config uses 24 MoE layers + pp=4
# (24 % 4 == 0; dualpipev: 24 % 8 == 0). dualpipe (not dualpipev) also takes an uneven split:
# NUM_LAYERS=27 with --decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 7 appended.
# Memory: 64 experts / ep=8 = 8 experts per rank per stage; DualPipe doubles them.
# Tokenizer: none set: pass --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (DeepSeek-V2's
#   tokenizer directory; the launch script refuses to start without a tokenizer).
# Minimum GPUs: 32 (Megatron needs a multiple of ETP*EP*PP = 1*8*4 with the defaults below).
PP=${PP:-4}; TP=${TP:-1}; EP=${EP:-8}
MICRO_BATCH=${MICRO_BATCH:-1}; GLOBAL_BATCH=${GLOBAL_BATCH:-256}
NUM_LAYERS=24
VOCAB_SIZE=${VOCAB_SIZE:-102400}   # DeepSeek-V2's vocabulary, for `megatron-dualpipe advise` (training reads the tokenizer's)
MODEL_ARGS=(
  --num-layers $NUM_LAYERS --hidden-size 2048 --ffn-hidden-size 10944 --num-attention-heads 16
  --multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128
  --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope --swiglu
  --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --bf16
  --num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1408 --moe-shared-expert-intermediate-size 2816
  --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
  --use-distributed-optimizer --lr 4.2e-4 --min-lr 4.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --train-iters 250000 --weight-decay 0.1 --clip-grad 1.0 --log-interval 10
  --eval-interval 1000 --eval-iters 10
)
