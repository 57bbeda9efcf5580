# Tiny GPT for the CPU smoke run (4 processes, gloo). Not a real model.
# Sourced by scripts/pretrain_gpt_dualpipe.sh and scripts/cpu_smoke.sh. The data and tokenizer
# arguments come from `megatron-dualpipe prepare-data` (cpu_smoke.sh runs it: Python's help texts,
# a byte-level BPE with vocabulary 1024, --split 90,10,0).
# Tokenizer: none set: scripts/cpu_smoke.sh passes prepare-data's (--tokenizer-type HuggingFaceTokenizer
#   --tokenizer-model DIR); with your own DATA_PATH pass the tokenizer it was made with.
# Minimum GPUs: 4 (Megatron needs a multiple of TP*PP*CP = 1*4*1 with the defaults below).
PP=${PP:-4}; TP=${TP:-1}; EP=${EP:-1}
MICRO_BATCH=${MICRO_BATCH:-2}; GLOBAL_BATCH=${GLOBAL_BATCH:-16}   # M = 16/(2*dp) = 8 = 2*pp at dp=1
NUM_LAYERS=8                                                       # divisible by pp and by 2*pp (dualpipev)
VOCAB_SIZE=${VOCAB_SIZE:-1024}   # prepare-data's byte-level BPE vocabulary, for `megatron-dualpipe advise` (training reads the tokenizer's)
MODEL_ARGS=(
  --num-layers $NUM_LAYERS --hidden-size 64 --num-attention-heads 4 --seq-length 64
  --max-position-embeddings 64
  --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion
  --use-cpu-initialization --distributed-backend gloo
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style constant --train-iters 10 --log-interval 1
  --eval-iters 0 --eval-interval 1000
)
