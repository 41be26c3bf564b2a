"""The planner's model of host offload: what crosses each device's host link per optimizer
step under `--offload optimizer | params` and `--remat offload`, how much of that time the step
pays, and the plan's figures and lines for it.

Per device, per optimizer step, with the update on the device (spmd.engine.offload):
  --offload: the state kept on the host (memory.HOST_ROLES: master weights and moments, with
    `params` the working params too) goes host -> device before the update and device -> host
    after it. PCIe is full duplex and the update goes leaf by leaf, so the copies in and out
    run at once: the time is one direction's bytes over the link. The update needs its state
    in before it starts and the next step needs it back, so this time is counted exposed
    (XLA may start the copies in earlier; that is not assumed).
  --remat offload: every micro-batch's forward sends dots_saveable's set of each layer to the
    host and the backward reads it back, layer by layer while the neighbouring layers compute,
    so each direction is hidden behind its pass's compute (forward a third of it, backward two
    thirds) and only the excess is exposed.
Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

from typing import Any

from spmd.estimate import cost, memory
from spmd.estimate.units import ms, si

FORWARD_SHARE = 1 / 3  # of a step's compute: the backward pass does twice the forward's FLOPs
# --offload values the search tries: params offload frees no device memory at the step's peak
# (spmd.estimate.memory.OFF_DEVICE_IN_STEP)
SEARCHED_OFFLOADS = ("none", "optimizer")


def uses_host(s: cost.Setup) -> bool:
    """Whether run `s` keeps anything in host memory (--offload or --remat offload)."""
    return s.offload != "none" or s.remat == "offload"


def split(state: dict[str, float], offload: str) -> dict[str, float]:
    """{"device", "host"}: the bytes of params and of master + optimizer state
    (memory.model_state_bytes' "params" and "optimizer") that `offload` keeps in each memory."""
    host = sum(state[role] for role in memory.HOST_ROLES[offload])
    return {"device": state["params"] + state["optimizer"] - host, "host": host}


def transfer_bytes(s: cost.Setup) -> dict[str, float]:
    """Bytes one device moves each way over its host link per optimizer step: "state" (the
    offloaded state, once) and "activations" (--remat offload's, every micro-batch)."""
    state = memory.model_state_bytes(s)
    return {
        "state": split(state, s.offload)["host"],
        "activations": memory.offloaded_activation_bytes(s) * s.micro_steps,
    }


def host_time(s: cost.Setup, bandwidth: float, compute: float) -> dict[str, float]:
    """Seconds of host transfers per optimizer step at `bandwidth` bytes/s each way, beside
    `compute` seconds of compute: "state" (exposed), "activations" (what each pass's compute
    does not hide) and "exposed" (their sum, what the step pays)."""
    if not uses_host(s):  # most of the search's candidates: nothing crosses the host link
        return {"state": 0.0, "activations": 0.0, "exposed": 0.0}
    moved = transfer_bytes(s)
    each_way = moved["activations"] / bandwidth
    forward = compute * FORWARD_SHARE
    activations = max(0.0, each_way - forward) + max(0.0, each_way - (compute - forward))
    state = moved["state"] / bandwidth
    return {"state": state, "activations": activations, "exposed": state + activations}


def figures(s: cost.Setup, mem: dict, time: dict, net: cost.Network) -> dict[str, Any]:
    """The plan's host figures (plain JSON values): what --offload and --remat offload keep
    in host memory per device and per node (of the devices on one) against the node's host
    memory, the bytes moved each way per step, and their seconds (total and exposed) at the
    network's host_bandwidth."""
    moved, bandwidth = transfer_bytes(s), net.host_bandwidth
    return {
        "offload": s.offload,
        "remat": s.remat,
        "state_bytes_per_device": round(mem["host_state"]),
        "activation_bytes_per_device": round(mem["host_activations"]),
        "devices_per_node": min(s.devices, net.devices_per_node),
        "bytes_per_node": round(mem["host_per_node"]),
        "memory_bytes_per_node": mem["host_memory"],
        "fits": mem["host_fits"],
        "bandwidth_gb_s": bandwidth / 1e9,
        "transfer_bytes_per_step": {k: round(v) for k, v in moved.items()},
        "transfer_time_s": sum(moved.values()) / bandwidth,
        "exposed_time_s": time["host"],
    }


def lines(host: dict) -> list[str]:
    """The table's lines for the host figures ([] when nothing is offloaded)."""
    if not host["state_bytes_per_device"] and not host["activation_bytes_per_device"]:
        return []
    kept = []
    if host["state_bytes_per_device"]:
        kept.append(f"--offload {host['offload']} {si(host['state_bytes_per_device'])}")
    if host["activation_bytes_per_device"]:
        kept.append(f"--remat offload {si(host['activation_bytes_per_device'])}")
    verdict = "fits" if host["fits"] else "does NOT fit"
    moved = host["transfer_bytes_per_step"]
    return [
        "",
        f"host memory per device: {', '.join(kept)}; per node ({host['devices_per_node']} "
        f"of its devices) {si(host['bytes_per_node'])} of {si(host['memory_bytes_per_node'])}: "
        f"{verdict}",
        f"  host link {host['bandwidth_gb_s']:g} GB/s each way per device: state "
        f"{si(moved['state'])} in and out per step, activations {si(moved['activations'])}; "
        f"{ms(host['transfer_time_s'])}, of which {ms(host['exposed_time_s'])} not hidden "
        f"behind compute",
    ]
