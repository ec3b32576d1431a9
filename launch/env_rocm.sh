#!/usr/bin/env bash
# RCCL and ROCm settings for multi-GPU / multi-node training on AMD Instinct (MI210, MI250, MI300X).
# The launch/ scripts source this file when they find ROCm (/dev/kfd, /opt/rocm, rocm-smi, or a ROCm torch);
# VIM_DS_GPU_ENV=rocm forces it, VIM_DS_GPU_ENV=none skips it.
#
#   source launch/env_rocm.sh        # into your own job script (does not change the shell's options)
#   bash launch/env_rocm.sh          # print what it would export on this node
#
# Every variable is set only where it is unset, so anything exported before (or in the job script) wins:
#   NCCL_SOCKET_IFNAME=ens1f0 NCCL_DEBUG=INFO bash launch/multi_node.sh ...
# RCCL reads the NCCL_* names.
# shellcheck shell=bash

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then  # run, not sourced: strict mode is ours to set
    set -euo pipefail
fi

# NIC for RCCL's bootstrap and socket traffic (and the TCP fallback). The default excludes loopback and docker
# bridges; set it to the cluster network's interface (e.g. "ens1f0", "hsn0", or "^lo,docker0,eno1" to also skip
# a management port) when nodes see several networks or the rendezvous stalls at start.
: "${NCCL_SOCKET_IFNAME:=^lo,docker}"

# InfiniBand / RoCE adapters for inter-node traffic. By default every HCA found in /sys/class/infiniband; set it to
# the adapters wired to the compute fabric (e.g. "mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_6,mlx5_7,mlx5_8,mlx5_9" on an
# 8xMI300X node with one NIC per GPU; AMD Pollara/Pensando: "ionic_0,...") and leave out storage or management ones.
if [[ -z ${NCCL_IB_HCA:-} && -d /sys/class/infiniband ]]; then
    _hcas=$(find /sys/class/infiniband -mindepth 1 -maxdepth 1 -printf '%f\n' 2>/dev/null | sort | paste -sd, -)
    [[ -z $_hcas ]] || NCCL_IB_HCA=$_hcas
    unset _hcas
fi
# RoCE (an HCA whose link layer is Ethernet) needs the GID index of its RoCE v2 / IPv4 address, usually 3
# (`show_gids` lists them); plain InfiniBand does not use it. Change it when `show_gids` shows another index for
# the "v2" entry with an IPv4 address.
if [[ -z ${NCCL_IB_GID_INDEX:-} ]] && grep -qs Ethernet /sys/class/infiniband/*/ports/*/link_layer; then
    NCCL_IB_GID_INDEX=3
fi

# NCCL_DEBUG: WARN is quiet; VIM_DS_NCCL_DEBUG=1 (or NCCL_DEBUG=INFO) prints the rings/trees, the transport per
# peer (IB, P2P/xGMI, SHM, socket) and the interfaces chosen: the first thing to look at when the first
# collective hangs or inter-node bandwidth is low.
if [[ ${VIM_DS_NCCL_DEBUG:-0} == 1 ]]; then
    : "${NCCL_DEBUG:=INFO}" "${NCCL_DEBUG_SUBSYS:=INIT,NET}"
fi
: "${NCCL_DEBUG:=WARN}"

# Lets RCCL use fine-grained (coherent) host memory over PCIe, which its inter-node path (IB/RoCE with GPUDirect
# RDMA) expects; AMD's multi-node guides set it. Leave it at 1.
: "${HSA_FORCE_FINE_GRAIN_PCIE:=1}"

# A dead or stuck peer makes the collective fail (and the job exit) instead of hanging until the timeout ends it.
: "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=1}"

# CPU threads per rank (intra-op). The deepspeed launcher divides the node's cores by the ranks only when this is
# unset; a fixed value keeps torchrun and the deepspeed launcher alike. Raise it if the CPU side (data loading in
# the main process, optimizer offload) is the bottleneck; data loader workers are separate processes.
if [[ -z ${OMP_NUM_THREADS:-} ]]; then
    _cores=$(nproc 2>/dev/null || echo 8)
    OMP_NUM_THREADS=$((_cores / ${GPUS_PER_NODE:-${NPROC:-8}}))
    [[ $OMP_NUM_THREADS -ge 1 ]] || OMP_NUM_THREADS=1
    unset _cores
fi

# MIOpen's kernel database and compiled-kernel cache, per node: the default (~/.config/miopen, ~/.cache/miopen)
# lives in a home directory shared by all nodes over NFS, where concurrent ranks lock each other out of the
# sqlite file or read half-written kernels. Point it at a node-local disk (e.g. /local/scratch/$USER) on systems
# with a small /tmp; keep it between jobs to skip kernel compilation.
_node=$(hostname -s 2>/dev/null || hostname)
: "${MIOPEN_USER_DB_PATH:=${TMPDIR:-/tmp}/miopen-${USER:-$(id -un)}-$_node}"
: "${MIOPEN_CUSTOM_CACHE_DIR:=$MIOPEN_USER_DB_PATH}"
unset _node
mkdir -p "$MIOPEN_USER_DB_PATH" "$MIOPEN_CUSTOM_CACHE_DIR" 2>/dev/null || true

export NCCL_SOCKET_IFNAME NCCL_DEBUG HSA_FORCE_FINE_GRAIN_PCIE TORCH_NCCL_ASYNC_ERROR_HANDLING OMP_NUM_THREADS \
    MIOPEN_USER_DB_PATH MIOPEN_CUSTOM_CACHE_DIR
[[ -z ${NCCL_IB_HCA:-} ]] || export NCCL_IB_HCA
[[ -z ${NCCL_IB_GID_INDEX:-} ]] || export NCCL_IB_GID_INDEX
[[ -z ${NCCL_DEBUG_SUBSYS:-} ]] || export NCCL_DEBUG_SUBSYS

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    for _var in NCCL_SOCKET_IFNAME NCCL_IB_HCA NCCL_IB_GID_INDEX NCCL_DEBUG NCCL_DEBUG_SUBSYS \
        HSA_FORCE_FINE_GRAIN_PCIE TORCH_NCCL_ASYNC_ERROR_HANDLING OMP_NUM_THREADS MIOPEN_USER_DB_PATH \
        MIOPEN_CUSTOM_CACHE_DIR; do
        [[ -z ${!_var:-} ]] || printf 'export %s=%q\n' "$_var" "${!_var}"
    done
fi
