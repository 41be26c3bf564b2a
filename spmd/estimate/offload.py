"""The planner's model of host offload (`--offload optimizer | params`): which bytes of a run's
state sit in host memory instead of device memory, how many cross the host link each step, and
what that costs in time against the step.

Per device, per optimizer step, with the update on the device (spmd.engine.offload):
  optimizer: the master weights and moments (memory.bytes_per_param's "optimizer" bytes, split
    as the ZeRO stage splits them) go host -> device before the update and device -> host after;
  params: the working params too, each way once a step.
PCIe is full duplex, so the two directions run at once: the transfer takes the bytes of one
direction over the link's bandwidth, and it adds to the step unless the step overlaps it with
compute (XLA's host offloader can start the copies early; that is not counted here).
Units: bytes, seconds, GB/s (1e9 bytes per second).
"""

from __future__ import annotations

from typing import Any

from spmd.estimate import cost, memory

# Sustained host <-> device bandwidth per GPU, one direction, GB/s: about 80 % of the PCIe link's
# peak (Gen4 x16: 32 GB/s on A100; Gen5 x16: 64 GB/s on H100 / H200). A planning default; the
# real figure depends on the host (pinned memory, NUMA, other devices sharing the switch).
HOST_LINK_GBPS = {"a100-40gb": 25.0, "a100-80gb": 25.0, "h100": 50.0, "h200": 50.0}


def split(state: dict[str, float], offload: str) -> dict[str, float]:
    """{"device", "host"}: the bytes of params and of master + optimizer state
    (memory.model_state_bytes' "params" and "optimizer") that `offload` keeps in each memory."""
    host = 0.0 if offload == "none" else state["optimizer"]
    host += state["params"] if offload == "params" else 0.0
    return {"device": state["params"] + state["optimizer"] - host, "host": host}


def figures(s: cost.Setup, offload: str, link_gbps: float, step_s: float) -> dict[str, Any]:
    """One device's figures for run `s` under `offload`: "device_state" and "host_state"
    (bytes of params + master + optimizer in each memory; gradients stay on the device),
    "device_total" (all of the device's model state: the device share plus the gradients),
    "transfer_bytes" (one direction, per step), "transfer_s" (at `link_gbps`), "step_s" (the
    step without offload, given) and "slowdown" ((step + transfer) / step, no overlap)."""
    state = memory.model_state_bytes(s)
    placed = split(state, offload)
    transfer_s = placed["host"] / (link_gbps * 1e9)
    return {
        "device_state": placed["device"],
        "host_state": placed["host"],
        "device_total": placed["device"] + state["grads"],
        "transfer_bytes": placed["host"],
        "transfer_s": transfer_s,
        "step_s": step_s,
        "slowdown": (step_s + transfer_s) / step_s if step_s else float("inf"),
    }


def host_bytes_per_node(host_state: float, devices_per_node: int) -> float:
    """Host memory one node needs for its devices' offloaded state (bytes)."""
    return host_state * devices_per_node
