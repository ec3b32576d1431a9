#!/usr/bin/env bash
# The README's main job: train a small Vim on real images with the deepspeed launcher, then print its validation
# accuracy. Uses scikit-learn's bundled handwritten digits (1,797 real 8x8 images, written as an ImageFolder), so
# it needs no download. All GPUs on a GPU machine; 2 processes (gloo) on a CPU-only machine.
#
#   bash launch/train_digits.sh [extra vim-ds train options]
#   DATA=data/digits OUT=runs/digits CONFIG=ds_configs/zero3.json bash launch/train_digits.sh --epochs 5
#   NPROC=1 bash launch/train_digits.sh          # ranks (default: all GPUs, or 2 CPU processes)
#   PRECISION=bf16 bash launch/train_digits.sh   # default: bf16 on GPUs and bf16-capable CPUs, else fp32
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${DATA:-data/digits}
OUT=${OUT:-runs/digits-$(date +%Y%m%d-%H%M%S)}
CONFIG=${CONFIG:-ds_configs/zero2.json}

[ -d "$DATA/train" ] || vim-ds data digits --out "$DATA"

# bf16 on GPUs and on CPUs with bf16 instructions; fp32 on other CPUs, where bf16 is emulated and about 4x slower
# (measured on a 2-core AVX2 EPYC: 4.5 s vs 1.1 s per training step of this model with 4-pixel patches).
# PRECISION=bf16|fp32 overrides.
PRECISION=${PRECISION:-auto}
if [ "$PRECISION" = auto ]; then
    PRECISION=fp32
    # shellcheck source=common.sh
    source launch/common.sh  # local_gpu_count, as launch/single_node.sh counts them
    if [ "$(local_gpu_count)" -gt 0 ] || grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then
        PRECISION=bf16
    fi
fi

# depth 6, width 96, 8-pixel patches on 32x32 inputs (16 patches and the class token): 0.5M parameters, 96.7-96.9 %
# top-1 after 12 epochs (seeds 0-2, bf16; 96.9 % in fp32), where 20 epochs gave 96.4-98.1 % for 1.7x the time.
# 4-pixel patches (65 tokens) cost 2.2x the CPU time for no better accuracy (docs/tests.md).
# Digits are not photos: no flips, milder crops, no RandAugment/Mixup/erasing.
# launch/single_node.sh: all GPUs, or NPROC (default 2) CPU processes; a free MASTER_PORT unless one is set.
exec bash launch/single_node.sh --deepspeed_config "$CONFIG" --precision "$PRECISION" --data-set folder --data-path "$DATA" \
    --output_dir "$OUT" --model vim_tiny --input-size 32 --model-kwargs depth=6 embed_dim=96 patch_size=8 stride=8 \
    --batch-size 64 --epochs 12 --warmup-epochs 2 --lr 2e-3 --unscale-lr --drop-path 0 \
    --aa none --reprob 0 --mixup 0 --cutmix 0 --hflip 0 --scale 0.5 1 --no-model-ema \
    --num_workers 1 --log-interval 50 "$@"
