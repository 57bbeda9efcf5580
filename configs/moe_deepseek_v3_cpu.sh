# DeepSeek-V3's recipe (configs/moe_deepseek_v3.sh) at CPU size, 4 processes, gloo. Not a real model.
# 4 layers (the first dense), multi-latent attention with YaRN RoPE (scaling 40, mscale 1), SwiGLU,
# RMSNorm, untied embeddings; 4 routed experts top-2 in 2 groups (1 picked) plus 1 shared, sigmoid
# scores with expert bias, routed output scaled by 2.5, the sequence-wise auxiliary loss; pp=2 x EP=2.
# tests/megatron_lm/test_megatron_lm_v3_recipe.py runs these options under 1f1b, dualpipe and
# dualpipev (every printed metric equal). Sourced by scripts/pretrain_gpt_dualpipe.sh and
# scripts/cpu_smoke.sh (CONFIG=moe_deepseek_v3_cpu).
# Tokenizer: none set: scripts/cpu_smoke.sh passes prepare-data's (--tokenizer-type HuggingFaceTokenizer
#   --tokenizer-model DIR); with your own DATA_PATH pass the tokenizer it was made with.
# Minimum GPUs: 4 (Megatron needs a multiple of ETP*EP*PP = 1*2*2 with the defaults below).
PP=${PP:-2}; TP=${TP:-1}; EP=${EP:-2}
MICRO_BATCH=${MICRO_BATCH:-2}; GLOBAL_BATCH=${GLOBAL_BATCH:-16}   # M = 16/(2*dp) = 4 = 2*pp at dp=2
NUM_LAYERS=4                                                       # divisible by pp and by 2*pp (dualpipev)
VOCAB_SIZE=${VOCAB_SIZE:-1024}   # prepare-data's byte-level BPE vocabulary, for `megatron-dualpipe advise` (training reads the tokenizer's)
MODEL_ARGS=(
  --num-layers $NUM_LAYERS --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64
  --multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8
  --v-head-dim 16 --position-embedding-type rope --rope-type yarn --rotary-scaling-factor 40 --mscale 1.0
  --mscale-all-dim 1.0
  --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear
  --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32
  --moe-layer-freq "([0]*1+[1]*$((NUM_LAYERS - 1)))" --moe-router-score-function sigmoid
  --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-num-groups 2
  --moe-router-group-topk 1 --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss
  --moe-aux-loss-coeff 1e-4 --moe-token-dispatcher-type alltoall
  --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion
  --use-cpu-initialization --distributed-backend gloo
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style constant --train-iters 10 --log-interval 1
  --eval-iters 0 --eval-interval 1000
)
