# Mixtral-8x7B-like MoE: 32 layers, hidden 4096, 8 experts top-2, expert parallel.
# DualPipe: pp=8, ep=8, tp=1; 32 % 8 == 0; DualPipeV: 32 % 16 == 0.
# Memory: experts dominate (~45B of 47B parameters); DualPipe doubles them per rank, so prefer
# dualpipev here unless ep is large enough (each rank holds 2 stages x 8/ep experts).
# Zero bubble defers the expert weight gradients only for SequentialMLP (--moe-grouped-gemm off);
# with grouped GEMM or transformer-engine experts the W step computes nothing extra.
# Tokenizer: none set: pass --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (Mixtral's
#   tokenizer directory; the launch script refuses to start without a tokenizer).
# Minimum GPUs: 64 (Megatron needs a multiple of ETP*EP*PP = 1*8*8 with the defaults below).
PP=${PP:-8}; TP=${TP:-1}; EP=${EP:-8}
MICRO_BATCH=${MICRO_BATCH:-1}; GLOBAL_BATCH=${GLOBAL_BATCH:-256}
NUM_LAYERS=32
VOCAB_SIZE=${VOCAB_SIZE:-32000}   # Mixtral's vocabulary, for `megatron-dualpipe advise` (training reads the tokenizer's)
MODEL_ARGS=(
  --num-layers $NUM_LAYERS --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 32768
  --position-embedding-type rope --rotary-base 1000000 --swiglu --normalization RMSNorm
  --untie-embeddings-and-output-weights --disable-bias-linear --bf16
  --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --use-distributed-optimizer --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 1000
  --train-iters 250000 --weight-decay 0.1 --clip-grad 1.0 --log-interval 10
  --eval-interval 1000 --eval-iters 10
)
