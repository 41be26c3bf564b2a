"""The planner's command line: its own config section (`PlanConfig`), which of spmd.train's
flags change a plan, and the help texts of `python -m spmd.plan --help`."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from spmd.engine.optimizers import OPTIMIZERS
from spmd.estimate import search
from spmd.run import config
from spmd.run.section_views import model_section
from spmd.sections import SECTIONS as RUN_SECTIONS


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """The planner's own settings. Units in comments (GB = 1e9 bytes)."""

    params: float = 0.0  # plan for this many parameters, e.g. 7e9 (0: the --model preset)
    tokens_per_step: int = 4 * 1024 * 1024  # without --batch: about this many tokens per step
    gpu: str = ""  # a key of search.GPUS: sets hbm, tflops, bandwidth, inter_bandwidth
    hbm: float = search.GPUS["h100"].hbm  # GB of memory per device
    overhead: float = 3.0  # GB per device for the runtime, communication buffers, fragmentation
    bandwidth: float = search.GPUS["h100"].bandwidth  # GB/s per device inside a node
    inter_bandwidth: float = search.GPUS["h100"].inter_bandwidth  # GB/s per device across nodes
    latency: float = 5e-6  # seconds per ring step
    devices_per_node: int = 8
    tflops: float = search.GPUS["h100"].tflops  # sustained TFLOP/s per device
    host_bandwidth: float = search.GPUS["h100"].host_bandwidth  # GB/s device <-> host, each way
    host_memory: float = search.GPUS["h100"].host_memory  # GB of host memory per node
    overlap: float = 0.0  # share of data-parallel communication hidden behind compute
    recommend: bool = False  # search mesh, ZeRO stage, micro-batch, accum, remat, schedule
    measure: bool = False  # compile the real step on simulated CPU devices and compare
    plot: str = ""  # write a picture of memory and step time to this PNG
    json: bool = False  # print one JSON object instead of the table


# spmd.train's flags that the planner defaults otherwise when they are not given: a
# pretraining-sized step (the run's precision and sequence length; said in the plan's report).
PLANNING_DEFAULTS: dict[str, Any] = {"precision": "bf16", "seq_len": 4096}
# All of spmd.plan's own defaults of spmd.train's fields (spmd.run.config.resolve's `defaults`):
# batch 0 is "about --tokens-per-step tokens"; the mesh puts every device on fsdp (on dp with
# --zero 0, which spmd.plan applies when --mesh is not given).
DEFAULTS: dict[str, Any] = {**PLANNING_DEFAULTS, "batch": 0, "mesh": "fsdp=-1"}


def own_fields(cls: type, taken: list[type]) -> type:
    """`cls` without the fields the `taken` sections already define: a flag has one owner
    (PrecisionConfig owns --precision; PlanConfig's `precision` is only the planner's default
    for it)."""
    names = {f.name for section in taken for f in dataclasses.fields(section)}
    hints = typing.get_type_hints(cls)
    kept = [f for f in dataclasses.fields(cls) if f.name not in names]
    if len(kept) == len(dataclasses.fields(cls)):
        return cls
    fields = [(f.name, hints[f.name], dataclasses.field(default=f.default)) for f in kept]
    return dataclasses.make_dataclass(cls.__name__, fields, frozen=True)


PLAN_SECTION = own_fields(PlanConfig, list(RUN_SECTIONS.values()))


def sections() -> dict[str, type]:
    """The planner's sections: spmd.train's (the model's flags: every registered family's
    fields) and its own."""
    return {"model": model_section(), **RUN_SECTIONS, "plan": PLAN_SECTION}


# The training flags that change the plan; the rest of spmd.train's are accepted and ignored.
TRAIN_FLAGS: tuple[str, ...] = (
    "model",
    "layout",
    "mesh",
    "devices",
    "zero",
    "batch",
    "accum",
    "seq_len",
)
TRAIN_FLAGS += ("precision", "grad_reduce", "pp_schedule", "microbatches", "pp_virtual")
TRAIN_FLAGS += ("lr", "lr_scaling", "ref_batch", "collectives", "sequence_parallel", "offload")
TRAIN_FLAGS += ("cp_mode",)
TRAIN_FLAGS += ("fp8_recipe", "fp8_min_dim", "fp8_all_gather", "optimizer")
TRAIN_FLAGS += ("init_from_hf", "init_from_peft", "lora_rank", "lora_targets")
TRAIN_FLAGS += ("lora_base_dtype", "adafactor_min_dim", "objective", "dpo_precompute_reference")
# Flags the search chooses itself; with --recommend they are refused rather than ignored.
SEARCHED_ONLY = ("accum", "microbatches")
HELP = {
    "params": "parameters to plan for, e.g. 8e9: the published shape of the current release "
    "nearest that size (Llama 3.x, Qwen3, Mistral Large 2; the plan names it) at that count "
    "(0: the --model preset, or --init-from-hf's model)",
    "init_from_hf": "plan the model of this Hugging Face folder or Hub id org/name: its "
    "config.json alone (a Hub id downloads nothing else)",
    "init_from_peft": "plan LoRA on the base this peft adapter folder names, with its rank "
    "and targets",
    "lora_rank": "plan LoRA adapters of this rank on a frozen base (0: full training)",
    "lora_base_dtype": "plan QLoRA: the frozen base stored as nf4 (0.5 B/param of 4-bit codes "
    "+ 1/16 B of scales) or int8 (1 B/param + 1/16 B)",
    "objective": "plan --objective dpo: a reference forward per step (no backward), and in "
    "a full fine-tune (no --lora-rank) the frozen reference copy's params",
    "dpo_precompute_reference": "plan DPO with its reference log-probs computed before "
    "training: no reference forward in the step and no reference copy",
    "precision": "fp32 (4 + 4 + 8 B/param: params, grads, Adam) or bf16 / fp16 (the ZeRO "
    "paper's mixed precision: 16-bit params and grads + fp32 master weights and Adam, "
    "2 + 2 + 12 B/param), or fp8 (bf16's bytes; the blocks' matmuls at twice the bf16 rate, "
    "MFU still against the bf16 peak)",
    "grad_reduce": "dtype of gradients and their reduction: fp32, or the 16-bit compute dtype "
    "(default: the compute dtype)",
    "tokens_per_step": "without --batch, the global batch is about this many tokens: "
    "tokens / --seq-len sequences, rounded to a multiple of the data-parallel size",
    # from the registry entries (fp32 values of state per param)
    "optimizer": "the update rule and its state per param beside the master weights: "
    + ", ".join(
        f"{o.name} 4 B, 4 (m + n) B per factored m x n matrix"
        if o.state_values is not None
        else f"{o.name} {4 * o.state_slots} B"
        if o.matrix_state_slots is None
        else f"{o.name} {4 * o.matrix_state_slots} B on hidden matrices, {4 * o.state_slots} B "
        "on the rest"
        for o in OPTIMIZERS.values()
    ),
    "gpu": f"{', '.join(search.GPUS)}: sets --hbm, --tflops, --bandwidth, --inter-bandwidth, "
    "--host-bandwidth and --host-memory to that GPU's node's (flags given beside it win); "
    "default: an H100 node",
    "hbm": "memory per device, GB (1e9 bytes)",
    "overhead": "GB per device reserved for the runtime, communication buffers, fragmentation",
    "bandwidth": "GB/s per device between devices of one node",
    "inter_bandwidth": "GB/s per device between nodes",
    "latency": "seconds per ring step (5e-6 = 5 microseconds)",
    "devices_per_node": "devices per node: tp stays within one; wider groups use --inter-bandwidth",
    "tflops": "sustained TFLOP/s per device, for the compute time",
    "host_bandwidth": "GB/s each way between a device and host memory (PCIe), for --offload "
    "and --remat offload",
    "host_memory": "GB of host memory per node, for what --offload and --remat offload keep there",
    "offload": "none, optimizer (master weights and moments in host memory) or params (the "
    "params too, --zero 3); --recommend tries optimizer and params when nothing fits without",
    "overlap": "share (0-1) of the data-parallel collectives (gradient reductions, ZeRO "
    "gathers) that runs behind compute; tensor and pipeline traffic never hides",
    "recommend": "search mesh (dp, fsdp, tp, pp; cp when nothing fits without), ZeRO stage, "
    "sequence parallelism, micro-batch and accum, remat and pipeline schedule for the fastest "
    "step that fits; --mesh axes, --zero, --remat, --sequence-parallel and --pp-schedule given "
    "alongside are held fixed",
    "measure": "compile the real train step on simulated CPU devices; show analytic vs compiled",
    "plot": "write a PNG: memory per device by role for ZeRO 0-3 and the layout, and where "
    "the step time goes",
    "json": "print one JSON object (bytes, seconds) instead of the table",
    "model": "model preset: configs/NAME.toml",
    "layout": "named layout from meshes/ (ddp, zero3, megatron, ...): sets --mesh and --zero",
    "mesh": "e.g. dp=2,fsdp=2,tp=2,pp=1 (one axis may be -1); default: every device "
    "data-parallel, on fsdp for --zero 1-3, on dp for --zero 0",
    "devices": "device count; 0 (the default): what --mesh needs, or --devices-per-node when "
    "an axis is -1",
    "zero": "0 = plain DDP; 1, 2, 3 = ZeRO stage of the fsdp axis",
    "batch": "global batch, sequences per optimizer step (default: about --tokens-per-step "
    "tokens, a multiple of the data-parallel size)",
    "accum": "accumulation micro-steps per optimizer step",
    "microbatches": "pipeline micro-batches per accumulation step (0: 2 x pp)",
    "seq_len": "tokens per sequence",
    "lr": "peak learning rate before the scaling rule (default: the planner's rule, about "
    "1 / width from published rates; docs/planning.md)",
    "lr_scaling": "none, or linear: lr x batch / ref-batch",
    "ref_batch": "the global batch at which --lr was tuned",
    "remat": "none, dots_saveable, full or offload (dots_saveable's set in host memory): what "
    "the backward pass keeps",
}


def help_parser(description: str) -> argparse.ArgumentParser:
    """The --help text: the planner's flags, the training flags that matter, the model's;
    `description` is the usage paragraph above them."""
    fields = [
        (f.name, typing.get_type_hints(section)[f.name], dataclasses.field(default=f.default))
        for section in RUN_SECTIONS.values()
        for f in dataclasses.fields(section)
        if f.name in TRAIN_FLAGS
    ]
    view = dataclasses.make_dataclass("TrainFlags", fields)
    sections = {"plan": PLAN_SECTION, "training run (every spmd.train flag is accepted)": view}
    sections["model (with --params only --remat applies)"] = model_section()
    parser = config.build_parser("python -m spmd.plan", sections, description, show_defaults=False)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    defaults = {
        f.name: f.default
        for cls in sections.values()
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING
    }
    defaults |= PLANNING_DEFAULTS
    shape = {
        f.name for f in dataclasses.fields(sections["model (with --params only --remat applies)"])
    }
    for action in parser._actions:
        action.help = HELP.get(action.dest, action.help)
        if action.dest in defaults and action.dest not in ("mesh", "devices", "batch", "lr"):
            action.help = f"{action.help or ''} (default {defaults[action.dest]!r})".lstrip()
        elif action.dest in shape:  # a shape field without a default of its own
            action.help = f"{action.help or ''} (default: the --model preset's)".lstrip()
    return parser
