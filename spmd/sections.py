"""The sections of a run's config: one frozen dataclass each, whose field defaults are the
single source of truth for every command and the library.

The bottom of spmd's package order (it imports nothing of spmd): each core package takes the
section it needs (spmd.engine.optim an OptimizerConfig, spmd.training.divergence a
DivergenceConfig, ...); the loop that runs a program takes `Config`, all sections together.
spmd.run.config resolves them from presets, files and flags. The model section is the model
family's own config (models/). Field names are unique across sections, so
every field is a flat flag: `seq_len` is `--seq-len`. The comment beside or above a field is
its --help text. A field with a fixed set of values is typed `Literal[...]`: that list is the
one table of its choices, which --help shows, the resolver checks, and the packages that act
on the field read through `choices`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

# The choice sets that more than one field or command takes, each written once.
# the compute dtypes: fp32, or 16-bit compute with fp32 master weights (spmd.engine.precision)
Precision = Literal["fp32", "bf16", "fp16", "fp8"]
# who writes the collectives (spmd.engine.step.EXECUTORS: the two executors)
Executor = Literal["auto", "explicit"]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What to train and for how long: the model preset, the batch arithmetic, the seed, the job's
    processes. `batch` is the global batch in sequences per optimizer step; `seq_len` in tokens."""

    model: str = "small"  # model preset: a file configs/<model>.toml with a [model] table
    steps: int = 200  # optimizer steps
    # or: passes over the training windows after packing; the steps are then
    # ceil(epochs x windows / batch), printed at the start (0: use --steps)
    epochs: int = 0
    batch: int = 32  # global batch: sequences per optimizer step, over all devices
    accum: int = 1  # micro-batches per optimizer step (each batch / accum sequences)
    seq_len: int = 128  # tokens per sequence
    seed: int = 0  # model init and data order
    # what the run minimises, an entry of spmd.engine.objectives (next_token: the family's
    # next-token cross-entropy)
    objective: str = "next_token"
    init_from_hf: str = ""  # start from a HF folder or Hub id org/name (its config.json: the model)
    # continue training a peft LoRA adapter: a folder with adapter_config.json and
    # adapter_model.safetensors; its base_model_name_or_path is the base (a folder or Hub id,
    # unless --init-from-hf names it) and r, lora_alpha, lora_dropout, target_modules the
    # --lora-* flags (a flag given that disagrees exits 2)
    init_from_peft: str = ""
    stop_after: int = 0  # end after this step with a checkpoint, as if preempted (0: don't)
    dry_run: bool = False  # compile the step, print memory and collectives, do not train
    coordinator: str = ""  # HOST:PORT of process 0 in a multi-process job (spmd.launch sets it)
    num_processes: int = 0  # processes in the job (0: from spmd.launch or a cluster JAX detects)
    process_id: int = -1  # this process's rank (-1: detect)
    # seconds to wait for the other processes of the job to join (the coordinator, every peer)
    # before giving up with one line (jax.distributed's initialization timeout)
    coordinator_timeout: int = 180
    # seconds a process of the job may go silent (stopped, killed, its host lost) before the
    # others end with one line naming it, before JAX's heartbeat deadline (0: spmd.launch's
    # --hang-timeout + 60, else 100)
    peer_timeout: int = 0
    # the run's folder: config.toml, metrics.jsonl, logs/, tensorboard/, checkpoints/, profile/
    # (empty: $SPMD_RUNS_DIR, else runs/, then --run-name; "none": no folder, only what the
    # path flags name); a path or a gs:// s3:// file:// URL
    run_dir: str = ""
    # the run folder's name (empty: <model>-<mesh>-<UTC time>, or -job<SLURM_JOB_ID> under
    # SLURM, so a requeued job finds its folder); give it to continue a run elsewhere
    run_name: str = ""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from: the corpus, its tokenizer and fields, the held-out split and
    eval sets."""

    # text file, folder of text files, token .bin, JSONL / Parquet / Arrow shards (a file, folder
    # or glob), or a mixture "web=a/*.parquet:0.7,code=b:0.3"; empty: the stdlib sources
    data: str = ""
    tokenizer: str = ""  # HF tokenizer.json, its folder or a Hub id (empty: bytes, vocabulary 256)
    data_cache: str = ""  # folder of tokenized corpora (empty: $XDG_CACHE_HOME or ~/.cache/spmd)
    text_field: str = "text"  # the text column of JSONL / Parquet / Arrow records
    prompt_field: str = ""  # SFT: the prompt column (not counted in the loss); + response_field
    response_field: str = ""  # SFT: the response column (the loss counts only its tokens)
    messages_field: str = ""  # chat SFT: a list of {role, content}, rendered by the chat template
    # preference pairs (--objective dpo / orpo): the preferred response column, after
    # --prompt-field's prompt (docs/strategies/preference.md); + rejected_field
    chosen_field: str = ""
    rejected_field: str = ""  # preference pairs: the dispreferred response column
    # what a record is (auto: told by the first record's fields, and printed): text (a text
    # field), chat (OpenAI `messages`), sharegpt (`conversations` of from/value), alpaca
    # (instruction/input/output, in the Alpaca prompt), preference (prompt/chosen/rejected)
    data_format: Literal["auto", "text", "chat", "sharegpt", "alpaca", "preference"] = "auto"
    # a record's renamed fields, FORMAT_KEY=NAME,...: e.g. conversations=dialog,from=speaker
    # (the keys each format reads: docs/data.md)
    data_fields: str = ""
    # the chat template of chats: chatml, llama3 or a FILE.jinja (empty: the tokenizer's)
    chat_template: str = ""
    # count the prompt tokens in the loss too (system and user turns, alpaca's instruction and
    # input, SFT prompts); off: the responses only
    train_on_input: bool = False
    skip_bad_records: bool = False  # count and report unusable records instead of exit 2
    tokenize_workers: int = 0  # processes tokenizing record shards (0: the machine's cores)
    # on: attention stays within each packed document, positions restart; off: as plain text;
    # auto: on for record corpora (JSONL / Parquet / Arrow), off for text files and token .bin
    document_mask: Literal["auto", "on", "off"] = "auto"
    eval_fraction: float = 0.02  # share of the corpus's windows held out for eval
    eval_data: str = ""  # eval sets beside the held-out split: a path, or "name=path,name=path"
    eval_every: int = 100  # steps between eval losses (0: only at the end)
    eval_batches: int = 4  # batches of `batch` sequences per eval
    # one eval before the first step of a fresh run (logged at step 0): the held-out loss of
    # the loaded weights, the "before" of a fine-tune
    eval_at_start: bool = False
    # lm-evaluation-harness every N steps on the current params (0: never; docs/evaluation.md)
    eval_harness_every: int = 0
    eval_harness_tasks: str = ""  # its lm-eval task names, comma-separated
    eval_harness_include_path: str = ""  # a folder of task YAMLs beside lm-eval's own tasks
    eval_harness_limit: int = 0  # documents per task (0: all)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer (AdamW by default), its LR schedule (linear warm-up, then a decay),
    DiLoCo's outer optimizer."""

    # the update rule, an entry of spmd.engine.optimizers (momentum: SGD with heavy-ball
    # momentum --beta1; muon: Muon on the hidden matrices, AdamW on the rest)
    optimizer: str = "adamw"
    lr: float = 3e-3  # peak learning rate (before the scaling rule)
    lr_scaling: Literal["none", "linear"] = "none"  # linear: lr * batch / ref_batch
    ref_batch: int = 32  # the global batch at which `lr` was tuned (for --lr-scaling linear)
    warmup: int = 20  # linear warm-up steps from 0 to the peak LR, then the schedule
    # after warm-up: cosine = cosine decay to min_lr_ratio x peak at the end of the run;
    # linear = linear decay to it; constant = stay at peak; wsd = warm-up, stable, decay: stay
    # at peak, then decay linearly to min_lr_ratio x peak over the last decay_fraction of steps
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    min_lr_ratio: float = 0.1  # the LR the decay ends at, as a fraction of the peak
    decay_fraction: float = 0.2  # wsd: the share of --steps the final decay takes, in (0, 1]
    weight_decay: float = 0.1  # decoupled (lr x weight_decay per step), matrices only
    # AdamW's decay rate of the gradient's running mean (momentum's momentum), in [0, 1)
    beta1: float = 0.9
    beta2: float = 0.95  # AdamW's decay rate of the squared gradient's running mean, in [0, 1)
    grad_clip: float = 1.0  # global L2 norm; 0 disables
    # lion: the rate that mixes the gradient into the sign's input, in [0, 1) (optax's b1)
    lion_beta1: float = 0.9
    lion_beta2: float = 0.99  # lion: the momentum's decay rate, in [0, 1) (optax's b2)
    muon_momentum: float = 0.95  # muon: the matrices' momentum decay rate, in [0, 1)
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations per orthogonalisation, >= 1
    # muon: the matrices' update RMS, as Moonlight's 0.2 x sqrt(max(m, n)) scale gives AdamW's
    # (so AdamW's LR transfers); 0: optax's unscaled update (orthogonal, RMS 1/sqrt(min(m, n)))
    muon_rms: float = 0.2
    # adafactor: factor a matrix's second moment into row and column means when both its sides
    # are at least this (optax's min_dim_size_to_factor); smaller ones keep it whole
    adafactor_min_dim: int = 128
    outer_lr: float = 0.7  # diloco: outer optimizer (SGD, Nesterov momentum) learning rate
    outer_momentum: float = 0.9  # diloco: outer Nesterov momentum (0: plain SGD)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The devices and how params are sharded over them: what every command that holds a
    model on a mesh takes (spmd.generate, spmd.convert; training's ParallelConfig extends it)."""

    mesh: str = "dp=-1"  # e.g. "dp=2,fsdp=2,tp=2"; one axis may be -1 (the rest)
    devices: int = 0  # simulate this many CPU devices per process (0: what the mesh needs)
    # what the fsdp axis shards: 0 nothing (plain DDP: a mesh without fsdp), 1 optimizer
    # state, 2 + gradients, 3 + params (a command that only holds params, generate or convert:
    # 0, 1 and 2 replicate them, 3 splits them)
    zero: int = 3


@dataclasses.dataclass(frozen=True)
class ParallelConfig(MeshConfig):
    """How the run is split over devices: the mesh and what fsdp shards (ZeRO: MeshConfig's
    fields), the executor, pipelines, gradient buckets, and the cross-host sync."""

    layout: str = ""  # named layout from meshes/ (ddp, zero3, megatron, ...); sets mesh + zero
    # who writes the collectives: auto = XLA inserts them (jit); explicit = spmd, by hand
    # (shard_map)
    collectives: Executor = "auto"
    sequence_parallel: bool = False  # Megatron-SP (tp > 1): norms/residuals split along length
    # how attention crosses a length split over `context` (cp > 1): ring = key / value blocks
    # passed round the devices; ulysses = all-to-alls to whole sequences of heads / cp heads
    # each (the heads must divide by cp); auto = ring
    cp_mode: Literal["auto", "ring", "ulysses"] = "auto"
    # gradient buckets in MiB: explicit = one psum / psum_scatter per bucket of grads (reverse
    # layer order); auto = XLA's collective combine thresholds (GPU); 0: one per param
    bucket_mb: float = 0.0
    # explicit ZeRO-3: all-gather layer i+1's params while layer i computes (forward and
    # backward); 0: each layer gathers its own params when it starts
    prefetch: bool = True
    # host offload: optimizer = the optimizer state (Adam's moments, and under bf16 / fp16 the
    # fp32 master weights) lives in host memory, streamed to the devices for each step; params
    # = the params too (needs --zero 3); none = everything in device memory
    offload: Literal["none", "optimizer", "params"] = "none"
    # throughput: on a GPU the XLA flags of docs/speed.md (yours win), on a CPU XLA's per-step
    # buffers on huge pages; none: neither
    xla_preset: Literal["throughput", "none"] = "throughput"
    pp_schedule: Literal["gpipe", "1f1b", "interleaved"] = "gpipe"  # pipeline schedule (pp > 1)
    microbatches: int = 0  # micro-batches per pipeline pass (per accum micro-step); 0: 2 x pp
    pp_virtual: int = 1  # chunks of layers per pipeline stage (interleaved: 2 or more)
    dcn_mesh: str = ""  # ways of each mesh axis that cross hosts, e.g. "dp=2" (empty: data first)
    # every-step: all-reduce the gradients over the data axis every step; diloco: each way of
    # the data axis is a replica taking --sync-every local steps, then one all-reduce of the
    # pseudo-gradient (start-of-round params - local params) feeds the outer optimizer
    dcn_sync: Literal["every-step", "diloco"] = "every-step"
    sync_every: int = 10  # diloco: inner steps per round (H); the all-reduce runs once per round
    diloco_axis: str = ""  # diloco on one host: the mesh axis of the replicas ("data")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """The dtypes of compute, working params and gradient reductions (the master weights stay
    fp32)."""

    # the compute and working-param dtype (the master weights stay fp32); fp8: bf16 whose
    # transformer blocks' matmuls are fp8 dots (docs/strategies/fp8.md)
    precision: Precision = "fp32"
    # dtype of gradient accumulation and of the cross-device gradient reduction: fp32, or the
    # 16-bit compute dtype; "" = the precision's default (its compute dtype, as in ZeRO)
    grad_reduce: Literal["", "fp32", "bf16", "fp16"] = ""
    # fp8 scaling: tensorwise (current per-tensor), rowwise (per row of the input, per column
    # of the weight), delayed (per-tensor from an amax history kept in the train state)
    fp8_recipe: Literal["tensorwise", "rowwise", "delayed"] = "tensorwise"
    # a block's matmul runs in fp8 only when its contracted and output dims both reach this
    # (smaller ones gain less than quantizing costs); 0: every block matmul
    fp8_min_dim: int = 512
    # ZeRO-3 (explicit executor) gathers the blocks' weights in e4m3 with their scales
    fp8_all_gather: bool = False
    fp8_history: int = 16  # steps of amax history under --fp8-recipe delayed
    # run fp8 emulated on a GPU without fp8 units (compute capability below 8.9)
    fp8_emulate: bool = False


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often the state is saved, how many steps are kept, whether to resume."""

    # folder or URL of checkpoints (empty: the run folder's checkpoints/; none: no checkpoints)
    checkpoint_dir: str = ""
    checkpoint_every: int = 100  # steps between checkpoints (0: only at the end or when stopped)
    keep_checkpoints: int = 3  # the newest this many checkpoints are kept, older ones deleted
    # auto: continue from the newest complete checkpoint in checkpoint_dir when there is one,
    # else start fresh; required: continue, exit 2 when there is none (`--resume` alone);
    # fresh: start at step 1, exit 2 when the folder holds checkpoints (they would be mixed;
    # also `never`, the way to start again a run whose every step was set aside as damaged)
    resume: Literal["auto", "required", "fresh"] = "auto"
    # resume from a step without a manifest.json (an spmd older than manifests, or a kill
    # before it was written): without this, a newer such step is set aside to <step>.unverified
    # and the newest verified one is used, and a folder of only such steps exits 2
    allow_unverified: bool = False


@dataclasses.dataclass(frozen=True)
class DivergenceConfig:
    """What a diverging run does (a non-finite loss or gradient norm, or a loss spike)."""

    # What a diverging run does (a non-finite loss or gradient norm, or a loss spike): stop =
    # save nothing more and exit with status 3, naming the newest finite checkpoint; rollback =
    # restore that checkpoint, skip the data of the steps it undoes, go on; ignore = go on.
    # Under every policy a state whose loss, gradient norm or params are not finite is never saved.
    on_divergence: Literal["stop", "rollback", "ignore"] = "stop"
    spike_threshold: float = 0.0  # a loss above this x the median of recent ones diverges (0: off)
    spike_window: int = 50  # how many recent finite losses (steps) the spike median is taken over
    max_rollbacks: int = 3  # rollbacks over the whole run (resumes included); then as `stop`
    rollback_lr_factor: float = 1.0  # each rollback multiplies the LR schedule by this, in (0, 1]


@dataclasses.dataclass(frozen=True)
class ObserveConfig:
    """What the run reports: progress lines, the metrics JSONL, TensorBoard, profiles, MFU."""

    log_every: int = 10  # steps between progress lines and JSONL train records
    log_level: Literal["debug", "info", "warning", "error"] = "info"  # console and rank files
    # experiment trackers fed the JSONL's numbers, comma-separated: tensorboard (into the run
    # folder), wandb, mlflow; "none": the JSONL only. A tracker that cannot start is one warning
    tracker: str = "tensorboard"
    metrics: str = ""  # path or URL of the metrics JSONL (empty: the run folder's metrics.jsonl)
    tensorboard: str = ""  # directory of TensorBoard scalars (empty: the run folder's tensorboard/)
    profile: str = ""  # START:STOP: trace those steps, print compute vs collectives per device
    # where the trace goes (empty: the --tensorboard dir, else the run folder's profile/, else
    # ./profile)
    profile_dir: str = ""
    comm_warn: float = 0.3  # warn when exposed communication exceeds this share of the step
    peak_tflops: float = 0.0  # dense peak TFLOP/s of one device for MFU (0: the device table)
    straggler_threshold: float = 0.2  # name a process this fraction slower than the median
    # steps between samples of --sample-prompts from the current params (0: none), written to
    # the run folder's samples.jsonl and the trackers
    sample_every: int = 0
    # the prompts of --sample-every: a text file of one prompt per line, or JSONL (.jsonl)
    # of records with a "prompt" string
    sample_prompts: str = ""
    sample_max_new_tokens: int = 32  # most tokens sampled after each prompt
    sample_temperature: float = 0.0  # softmax temperature of the samples; 0 is greedy


# The value a flag given alone means (`--resume` is `--resume required`, as when it was a bool).
BARE_FLAG_VALUES: dict[str, str] = {"resume": "required"}
# Values a field took before it changed type, read as the value meaning the same now: old TOML
# files' `resume = true / false`, old command lines' `--resume true / false`; `--resume never`
# is another name of fresh.
FORMER_VALUES: dict[str, dict[Any, str]] = {
    "resume": {
        True: "required",
        False: "fresh",
        "true": "required",
        "false": "fresh",
        "never": "fresh",
    }
}


# section name -> its dataclass, in the order a resolved config is printed
@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA fine-tuning (docs/strategies/lora.md): a frozen base and low-rank adapters on the
    family's projections (models/lora.py), trained alone."""

    lora_rank: int = 0  # rank r of each adapter (0: no LoRA, every param is trained)
    lora_alpha: float = 0.0  # the adapters' scale is alpha / rank, as in peft (0: 2 x rank)
    # dropout on the adapters' input in training, in [0, 1) (models/adapter.py)
    lora_dropout: float = 0.0
    # comma list of the family's projections to adapt, e.g. q,k,v,o,gate,up,down (empty: the
    # family's default; an unknown name lists the valid ones)
    lora_targets: str = ""
    # how the frozen base's block matrices are stored: empty = the working dtype; nf4 = QLoRA's
    # 4-bit NormalFloat codes; int8 = int8 codes with an absmax per 64 values (models/int8.py);
    # either dequantized inside each matmul (models/nf4.py)
    lora_base_dtype: str = ""


# The batch key of a preference-pair batch's response-token mask (int32 0/1 [rows, length]),
# which the data (spmd.io.pairs) writes and the objectives (spmd.engine.preference) read: here,
# below both packages.
PAIRS = "response"
# The batch key of DPO's reference log-probs computed once before training
# (--dpo-precompute-reference, spmd.reference_cache): float32 [rows, length], each row's
# figure at its first position and 0 elsewhere, so that it rides in the batch's own layout
# (every split of rows and of positions) and a row's sum over its positions gives it back.
REFERENCE_CACHE = "reference_cache"
FLOAT_FIELDS = ("weights", REFERENCE_CACHE)  # the batch keys that are float32, not int32


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """The preference objectives' knobs (--objective dpo / orpo, spmd.engine.preference)."""

    dpo_beta: float = 0.1  # DPO's beta: the implicit reward is beta x the log-prob ratio (> 0)
    # DPO's label smoothing: the assumed share of flipped preferences, in [0, 0.5) (cDPO)
    dpo_label_smoothing: float = 0.0
    # sigmoid: DPO's -log sigmoid(beta x margin); ipo: (margin - 1 / (2 beta))^2 on mean log-probs
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"
    orpo_lambda: float = 0.1  # ORPO's weight of the odds-ratio term beside the chosen NLL (> 0)
    # a full fine-tune's DPO reference: a frozen copy read from this spmd checkpoint folder,
    # Hugging Face folder or Hub id, laid out as the policy (spmd.dpo_reference); "" = none
    dpo_reference: str = ""
    # compute DPO's reference log-probs of every pair once before the first step (on LoRA's
    # base or the --dpo-reference model) and read them with the data: no reference forward in
    # the step, and a full fine-tune's step holds no reference copy (spmd.reference_cache)
    dpo_precompute_reference: bool = False


SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "parallel": ParallelConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "divergence": DivergenceConfig,
    "observe": ObserveConfig,
    "lora": LoraConfig,
    "preference": PreferenceConfig,
}


@dataclasses.dataclass(frozen=True)
class Config:
    """A training run's config: the model family's section and spmd.sections' sections."""

    model: Any
    run: RunConfig = RunConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    parallel: ParallelConfig = ParallelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    divergence: DivergenceConfig = DivergenceConfig()
    observe: ObserveConfig = ObserveConfig()
    lora: LoraConfig = LoraConfig()
    preference: PreferenceConfig = PreferenceConfig()

    @classmethod
    def of(cls, sections: dict[str, Any]) -> Config:
        """The Config of resolved `sections` (a command's extra sections are left out)."""
        return cls(**{f.name: sections[f.name] for f in dataclasses.fields(cls)})

    def sections(self) -> dict[str, Any]:
        """{section name: section}, model first."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """{section name: its fields as plain values}, e.g. for checkpoints and metrics."""
        return {name: dataclasses.asdict(value) for name, value in self.sections().items()}


def flat_values(saved: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every non-model field of a saved config (a checkpoint's or a metrics record's), in one
    dict: sectioned configs and older ones with a single [train] table read alike."""
    tables = (table for name, table in saved.items() if name != "model" and isinstance(table, dict))
    return {k: v for table in tables for k, v in table.items()}


def choices(cls: type, field: str) -> tuple[Any, ...]:
    """The values field `field` of section `cls` may take: its `Literal[...]`'s (() for a
    field of another type)."""
    return literal_choices(typing.get_type_hints(cls)[field])


def literal_choices(kind: Any) -> tuple[Any, ...]:
    """The values of a `Literal[...]` type, () for any other type."""
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else ()


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")
