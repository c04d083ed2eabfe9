"""Which GPUs an ernie_moe instance's engine runs on (--data-parallel-size N: N instances, each its own engine).

Each instance is its own stub process, so the GPUs are handed over the way every CUDA framework reads them: this
process's CUDA_VISIBLE_DEVICES, set to the instance's slice before Paddle or torch first touches CUDA. Inside, the
engine's ranks are GPUs 0..tensor_parallel_size-1, and everything keyed by device index (Paddle's memory figures,
CUDA graphs, NCCL, the tensor-parallel workers, which inherit the environment) stays on the instance's own GPUs.

Replica k takes visible GPUs [k * tp, (k + 1) * tp). With instance_group KIND_CPU (the repository's default, which
also loads on a machine without GPUs) Triton names the instances <group>_<k> (`ernie_moe_0_1`) and gives every one
device id 0, so k comes from the name; with KIND_GPU Triton places each instance on a GPU and says which
(model_instance_device_id), and that GPU starts the slice. A lone KIND_CPU instance keeps the environment as it is.
"""
from __future__ import annotations

import json
import os
from typing import Mapping, MutableMapping

from .. import devices

VISIBLE = "CUDA_VISIBLE_DEVICES"


def instance_ordinal(args: Mapping[str, str]) -> int:
    """The instance's index within its group, from Triton's `<group>_<k>` instance name."""
    name = args.get("model_instance_name", "")
    tail = name.rsplit("_", 1)[-1]
    if not tail.isdigit():
        raise ValueError(f"model instance name {name!r} does not end in its index (<group>_<k>)")
    return int(tail)


def instance_count(args: Mapping[str, str]) -> int:
    """How many instances the model's instance groups start (1 when the config names none)."""
    groups = json.loads(args.get("model_config") or "{}").get("instance_group") or [{}]
    return sum(int(g.get("count", 1)) for g in groups)


def instance_gpus(args: Mapping[str, str], tensor_parallel_size: int, visible: list[str] | None,
                  device_count: int) -> list[str] | None:
    """The GPUs (as CUDA_VISIBLE_DEVICES entries) this instance's engine owns; None to leave the environment as it
    is (a single KIND_CPU instance). `visible`: the parent's CUDA_VISIBLE_DEVICES entries, None when unset (then
    the machine's `device_count` GPUs, by index)."""
    tp = max(int(tensor_parallel_size), 1)
    if args.get("model_instance_kind") == "GPU":
        first = int(args.get("model_instance_device_id", 0))
    elif instance_count(args) > 1:
        first = instance_ordinal(args) * tp
    else:
        return None
    pool = visible if visible is not None else [str(i) for i in range(device_count)]
    if first + tp > len(pool):
        raise ValueError(f"instance {args.get('model_instance_name')!r} needs GPUs {first}..{first + tp - 1} "
                         f"(tensor_parallel_size={tp} each, replicas side by side) and {len(pool)} are visible "
                         f"({VISIBLE}={','.join(pool) or 'unset'}); lower --data-parallel-size or "
                         "--tensor-parallel-size, or make more GPUs visible")
    return pool[first:first + tp]


def pin_instance_gpus(args: Mapping[str, str], tensor_parallel_size: int,
                      environ: MutableMapping[str, str] = os.environ, gpu_nodes: list[str] | None = None) -> str | None:
    """Set this process's CUDA_VISIBLE_DEVICES to the instance's GPUs, on a machine with NVIDIA GPUs (`gpu_nodes`,
    by default devices.nvidia_device_nodes()), and return it; None when nothing changed. Call before anything
    imports a CUDA framework."""
    nodes = devices.nvidia_device_nodes() if gpu_nodes is None else gpu_nodes
    if not nodes:
        return None
    raw = environ.get(VISIBLE)
    visible = None if raw is None else [d.strip() for d in raw.split(",") if d.strip()]
    gpus = instance_gpus(args, tensor_parallel_size, visible, len(nodes))
    if gpus is None:
        return None
    environ[VISIBLE] = ",".join(gpus)
    return environ[VISIBLE]
