# Llama-3-8B class dense GPT: 32 layers, hidden 4096, 32 heads (8 KV groups), SwiGLU, RoPE.
# DualPipe: pp=8 (even), tp=2 within a node; 32 % 8 == 0; DualPipeV: 32 % 16 == 0.
# Memory: DualPipe doubles the parameters per rank (8B/8*2 = 2B parameters per pp rank before
# tp: with tp=2 ~1B per GPU, ~16 GB with bf16 weights, fp32 grads and the distributed optimizer
# over dp); if that does not fit, use dualpipev (1x parameters) or more tp.
# Tokenizer: none set (Llama-3's is a HuggingFace one): pass --tokenizer-type HuggingFaceTokenizer
#   --tokenizer-model DIR (the launch script refuses to start without a tokenizer).
# Minimum GPUs: 16 (Megatron needs a multiple of TP*PP*CP = 2*8*1 and of ETP*EP*PP = 2*1*8 with the defaults below).
PP=${PP:-8}; TP=${TP:-2}; EP=${EP:-1}
MICRO_BATCH=${MICRO_BATCH:-1}; GLOBAL_BATCH=${GLOBAL_BATCH:-512}   # M = 512/dp >= 2*pp for dp <= 32
NUM_LAYERS=32
VOCAB_SIZE=${VOCAB_SIZE:-128256}   # Llama 3's vocabulary, for `megatron-dualpipe advise` (training reads the tokenizer's)
MODEL_ARGS=(
  --num-layers $NUM_LAYERS --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192
  --position-embedding-type rope --rotary-base 500000 --swiglu --normalization RMSNorm
  --untie-embeddings-and-output-weights --disable-bias-linear --bf16 --sequence-parallel
  --use-distributed-optimizer --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --train-iters 500000 --weight-decay 0.1 --clip-grad 1.0 --log-interval 10
  --eval-interval 1000 --eval-iters 10
)
