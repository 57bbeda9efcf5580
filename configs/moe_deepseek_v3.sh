# DeepSeek-V3 (671B, 37B active) as DeepSeek-V3's report describes it: 61 layers (the first 3 dense),
# hidden 7168, multi-latent attention, 256 routed experts top-8 plus 1 shared, sigmoid routing with
# expert bias and group-limited routing (8 groups, top 4), routed-expert scaling 2.5, vocabulary 129280.
# One multi-token-prediction layer (--mtp-num-layers 1), as DeepSeek trained it.
# Pipeline: pp=16 with uneven stages for dualpipe (61 layers: 3 + 14 x 4 + 2; the first stage keeps
# the 3 dense layers beside the embedding, the last 2 MoE layers and MTP beside the output head);
# dualpipev: 32 V-stages in the layout Et|(tt|)*29,t|tL (rank 0 holds V-stages 0 and 31: the embedding
# and the output head), without MTP so far (MTP with a --pipeline-model-parallel-layout is refused).
# DeepSeek ran PP16 x EP64 on 2048 GPUs; here EP=32 so that 64 nodes x 8 GPUs (dp=32) start it.
# Memory: DualPipe doubles each rank's parameters (its mirror stage); on 80 GB GPUs the optimizer
# state of both copies does not fit without --dualpipe-shared-shard-group (see `megatron-dualpipe
# advise --config moe_deepseek_v3 --gpu H100 --nodes 64`).
# Tokenizer: none set: pass --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (DeepSeek-V3's).
# Minimum GPUs: 512 (Megatron needs a multiple of ETP*EP*PP = 1*32*16 with the defaults below).
PP=${PP:-16}; TP=${TP:-1}; EP=${EP:-32}
MICRO_BATCH=${MICRO_BATCH:-1}; GLOBAL_BATCH=${GLOBAL_BATCH:-4096}   # M = 4096/32 = 128 = 8pp
NUM_LAYERS=${NUM_LAYERS:-61}
UNEVEN=()
if [ "$NUM_LAYERS" = 61 ] && [ "${SCHEDULE:-dualpipe}" = dualpipev ]; then
  UNEVEN=(--pipeline-model-parallel-layout 'Et|(tt|)*29,t|tL')
elif [ "$NUM_LAYERS" = 61 ]; then
  UNEVEN=(--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2 --mtp-num-layers 1)
fi
MODEL_ARGS=(
  --num-layers $NUM_LAYERS "${UNEVEN[@]}" --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
  --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
  --v-head-dim 128 --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope
  --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --bf16
  --vocab-size 129280 --make-vocab-size-divisible-by 128
  --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048
  --moe-layer-freq "([0]*3+[1]*$((NUM_LAYERS - 3)))" --moe-router-score-function sigmoid
  --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-num-groups 8
  --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss
  --moe-aux-loss-coeff 1e-4 --moe-token-dispatcher-type alltoall
  --use-distributed-optimizer --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --train-iters 500000 --weight-decay 0.1 --clip-grad 1.0 --log-interval 10
  --eval-interval 1000 --eval-iters 10
)
