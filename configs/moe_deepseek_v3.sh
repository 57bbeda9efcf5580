# DeepSeek-V3 (671B, 37B active) as DeepSeek-V3's report describes it: 61 layers (the first 3 dense),
# hidden 7168, multi-latent attention, 256 routed experts top-8 plus 1 shared, sigmoid routing with
# expert bias and group-limited routing (8 groups, top 4), routed-expert scaling 2.5, vocabulary 129280.
# One multi-token-prediction layer (--mtp-num-layers 1), as DeepSeek trained it.
# Pipeline: pp=16 with uneven stages for dualpipe (61 layers: 3 + 14 x 4 + 2; the first stage keeps
# the 3 dense layers beside the embedding, the last 2 MoE layers and MTP beside the output head);
# dualpipev: 32 V-stages in the layout Et|(tt|)*29,t|tL (rank 0 holds V-stages 0 and 31: the embedding
# and the output head), without MTP so far (MTP with a --pipeline-model-parallel-layout is refused).
# Stated GPU count: 256 nodes x 8 (2048 GPUs), PP16 x EP64 as DeepSeek ran it (DP 128). EP64 needs a
# multiple of PP*EP = 1024 GPUs; below that EP defaults to 32 (e.g. 64 nodes x 8 = 512 GPUs, DP 32).
# Memory (H800/H100, 80 GB; `megatron-dualpipe advise --config moe_deepseek_v3 --gpu H800 --nodes 256`):
# recomputation of the RMSNorms and the MLA up-projections, as DeepSeek did, and of the MoE layers
# (--recompute-modules layernorm mla_up_proj moe: DeepSeek's FP8 activation storage is not Megatron's);
# dualpipe with --dualpipe-shared-shard-group keeps one optimizer state for both stage copies:
# 78.0 GB per GPU at 2048 GPUs (dualpipe, 14% shorter iterations than 1F1B). At 512 GPUs (EP32) only
# dualpipev fits (75.7 GB): the launcher refuses dualpipe there and names SCHEDULE=dualpipev.
# Tokenizer: none set: pass --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (DeepSeek-V3's).
# Minimum GPUs: 512 (EP=32 below 1024 GPUs: a multiple of ETP*EP*PP = 1*32*16; EP64 from 1024).
PP=${PP:-16}; TP=${TP:-1}
EP=${EP:-$(( ${NNODES:-1} * ${GPUS_PER_NODE:-8} >= 1024 ? 64 : 32 ))}
MICRO_BATCH=${MICRO_BATCH:-1}; GLOBAL_BATCH=${GLOBAL_BATCH:-4096}   # M = 4096/128 = 32 = 2pp at 2048 GPUs
NUM_LAYERS=${NUM_LAYERS:-61}
SCHEDULE=${SCHEDULE:-dualpipe}
UNEVEN=()
if [ "$NUM_LAYERS" = 61 ] && [ "$SCHEDULE" = dualpipev ]; then
  UNEVEN=(--pipeline-model-parallel-layout 'Et|(tt|)*29,t|tL')
elif [ "$NUM_LAYERS" = 61 ]; then
  UNEVEN=(--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2 --mtp-num-layers 1)
fi
SHARED=()
if [ "$SCHEDULE" = dualpipe ]; then SHARED=(--dualpipe-shared-shard-group --ckpt-format torch); fi  # its state: torch format
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
  --recompute-granularity selective --recompute-modules layernorm mla_up_proj moe "${SHARED[@]}"
  --use-distributed-optimizer --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --train-iters 500000 --weight-decay 0.1 --clip-grad 1.0 --log-interval 10
  --eval-interval 1000 --eval-iters 10
)
