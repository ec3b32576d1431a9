#!/usr/bin/env bash
# NCCL settings for multi-GPU / multi-node training on NVIDIA GPUs: the counterpart of launch/env_rocm.sh.
# The launch/ scripts source this file when they find an NVIDIA driver (/dev/nvidiactl or nvidia-smi);
# VIM_DS_GPU_ENV=nvidia forces it, VIM_DS_GPU_ENV=none skips it.
#
#   source launch/env_nvidia.sh      # into your own job script (does not change the shell's options)
#   bash launch/env_nvidia.sh        # print what it would export on this node
#
# Every variable is set only where it is unset, so anything exported before (or in the job script) wins.
# shellcheck shell=bash

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then  # run, not sourced: strict mode is ours to set
    set -euo pipefail
fi

# NIC for NCCL's bootstrap and socket traffic. The default excludes loopback and docker bridges; name the cluster
# network's interface (e.g. "ib0", "ens1f0") when nodes see several networks or the rendezvous stalls at start.
: "${NCCL_SOCKET_IFNAME:=^lo,docker}"

# InfiniBand / RoCE adapters: by default every HCA in /sys/class/infiniband; restrict it to the compute fabric's
# (e.g. "mlx5_0,mlx5_1,..." or "=mlx5_0:1" for one port) to leave storage and management adapters out.
if [[ -z ${NCCL_IB_HCA:-} && -d /sys/class/infiniband ]]; then
    _hcas=$(find /sys/class/infiniband -mindepth 1 -maxdepth 1 -printf '%f\n' 2>/dev/null | sort | paste -sd, -)
    [[ -z $_hcas ]] || NCCL_IB_HCA=$_hcas
    unset _hcas
fi
# RoCE only: the GID index of the RoCE v2 / IPv4 address, usually 3 (`show_gids`); InfiniBand ignores it.
if [[ -z ${NCCL_IB_GID_INDEX:-} ]] && grep -qs Ethernet /sys/class/infiniband/*/ports/*/link_layer; then
    NCCL_IB_GID_INDEX=3
fi

# WARN is quiet; VIM_DS_NCCL_DEBUG=1 (or NCCL_DEBUG=INFO) shows topology, transports (IB, NVLink/P2P, SHM,
# socket) and interfaces: the first thing to look at when the first collective hangs or bandwidth is low.
if [[ ${VIM_DS_NCCL_DEBUG:-0} == 1 ]]; then
    : "${NCCL_DEBUG:=INFO}" "${NCCL_DEBUG_SUBSYS:=INIT,NET}"
fi
: "${NCCL_DEBUG:=WARN}"

# A dead or stuck peer makes the collective fail (and the job exit) instead of hanging until the timeout ends it.
: "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=1}"

# CPU threads per rank: the node's cores divided by its ranks (what the deepspeed launcher does only when unset,
# and torchrun sets 1). Raise it if the CPU side (main-process data loading, optimizer offload) is the bottleneck.
if [[ -z ${OMP_NUM_THREADS:-} ]]; then
    _cores=$(nproc 2>/dev/null || echo 8)
    OMP_NUM_THREADS=$((_cores / ${GPUS_PER_NODE:-${NPROC:-8}}))
    [[ $OMP_NUM_THREADS -ge 1 ]] || OMP_NUM_THREADS=1
    unset _cores
fi

export NCCL_SOCKET_IFNAME NCCL_DEBUG TORCH_NCCL_ASYNC_ERROR_HANDLING OMP_NUM_THREADS
[[ -z ${NCCL_IB_HCA:-} ]] || export NCCL_IB_HCA
[[ -z ${NCCL_IB_GID_INDEX:-} ]] || export NCCL_IB_GID_INDEX
[[ -z ${NCCL_DEBUG_SUBSYS:-} ]] || export NCCL_DEBUG_SUBSYS

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    for _var in NCCL_SOCKET_IFNAME NCCL_IB_HCA NCCL_IB_GID_INDEX NCCL_DEBUG NCCL_DEBUG_SUBSYS \
        TORCH_NCCL_ASYNC_ERROR_HANDLING OMP_NUM_THREADS; do
        [[ -z ${!_var:-} ]] || printf 'export %s=%q\n' "$_var" "${!_var}"
    done
fi
