# GPT-2 medium class (345M parameters): 24 layers, hidden 1024, 16 heads.
# DualPipe: pp=4 (even), 24 % 4 == 0; DualPipeV: 24 % 8 == 0.
# Memory: DualPipe holds both copies of its two stages, i.e. 2x the parameters, gradients and
# optimizer state of 1F1B per rank (345M/4*2 ~ 173M parameters per rank: ~2.8 GB in fp32 Adam
# plus bf16 weights); DualPipeV holds 1x (two half-stages). Activations: pp+1 micro-batches in
# flight per rank at peak (1F1B: pp on rank 0).
# Tokenizer: GPT-2's BPE (set below): pass --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt
#   after the script's variables (the launch script refuses to start without them).
# Minimum GPUs: 4 (Megatron needs a multiple of TP*PP*CP = 1*4*1 with the defaults below).
PP=${PP:-4}; TP=${TP:-1}; EP=${EP:-1}
MICRO_BATCH=${MICRO_BATCH:-4}; GLOBAL_BATCH=${GLOBAL_BATCH:-256}  # M = 64/dp >= 2*pp for dp <= 8
NUM_LAYERS=24
VOCAB_SIZE=${VOCAB_SIZE:-50257}   # GPT-2's BPE vocabulary, for `megatron-dualpipe advise` (training reads the tokenizer's)
MODEL_ARGS=(
  --num-layers $NUM_LAYERS --hidden-size 1024 --num-attention-heads 16 --seq-length 2048
  --max-position-embeddings 2048 --bf16 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
  --lr-warmup-iters 2000 --train-iters 300000 --weight-decay 0.1 --clip-grad 1.0
  --tokenizer-type GPT2BPETokenizer --log-interval 10 --eval-interval 1000 --eval-iters 10
)
