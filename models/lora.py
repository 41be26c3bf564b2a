"""LoRA: low-rank adapters beside a frozen base model (Hu et al. 2021, in Hugging Face peft's
form).

A target is a projection a family names in its contract (`Family.lora_targets`: "q" -> the
param paths it adapts). For a base weight W [*in, *out] (its first `in_dims` dims contracted)
the adapter is A [*in, r] and one B [r, *out] per path: the effective weight is
W + (alpha / r) * A @ B. A target with several paths (Phi-3's fused qkv_proj) shares one A, as
peft's one Linear does, and its B's concatenated along the output are peft's lora_B. Stacked
params (under `blocks`) carry the `layers` dim on A and B too, so a pipeline stage holds its
layers' adapters.

A follows the base weight's input logical axes, B its output axes, the rank dim has no name
(replicated): under every layout each device's block of A @ B is exactly the block of W it
holds. A starts as peft's kaiming-uniform (a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))),
B at zeros: the model starts as the base, exactly.

`LoraModel` holds the base under `frozen` (the engine differentiates and optimizes everything
else: spmd.engine.frozen) and the adapters under `lora`. Training runs `adapted()`: the base
model with each adapter beside its projection (models/adapter.py: y = x W + scale *
dropout(x) A B, as peft computes it), on which the family's own loss and pipeline pieces run.
`merged()` is the base model with every target's weight W + scale * A @ B, for export and
generation (one merge, no adapter matmuls per token).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import adapter, layer_groups, nf4
from models.hf_tensors import DENSE_STACK, STACKED, STACKS, Rule
from spmd.errors import UsageError
from spmd.parallel.hooks import chunk_inputs, first_layer, training, training_step

# The projections of a Llama-shaped block (its param paths), by peft's short names.
ATTENTION: dict[str, tuple[tuple[str, ...], ...]] = {
    "q": ((STACKED, "attn", "wq"),),
    "k": ((STACKED, "attn", "wk"),),
    "v": ((STACKED, "attn", "wv"),),
    "o": ((STACKED, "attn", "wo"),),
}
MLP: dict[str, tuple[tuple[str, ...], ...]] = {
    "gate": ((STACKED, "mlp", "w_gate"),),
    "up": ((STACKED, "mlp", "w_up"),),
    "down": ((STACKED, "mlp", "w_down"),),
}
DENSE = ATTENTION | MLP
# What a QLoRA base stores in NF4 beside its projections: the token table (tied head too) and
# an untied head, read through models.layers.stored (never adapted)
EMBEDDINGS = (("embed",), ("lm_head",))


@dataclasses.dataclass(frozen=True)
class Spec:
    """One run's adapters: rank r (count), alpha (scale = alpha / r), the targets, each
    name -> its param paths (the family's table, narrowed to the chosen names), the
    dropout probability on the adapters' input in training, and the frozen base's storage
    (`base_dtype`, models/nf4.py: "" the working dtype, "nf4" 4-bit codes or "int8" int8
    codes, models/int8.py, of every projection the family's table names, adapted or not, in
    `quantized`)."""

    rank: int
    alpha: float
    targets: dict[str, tuple[tuple[str, ...], ...]]
    dropout: float = 0.0
    base_dtype: str = ""
    quantized: dict[str, tuple[tuple[str, ...], ...]] = dataclasses.field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def spec_of(
    table: dict[str, tuple[tuple[str, ...], ...]],
    default: tuple[str, ...],
    family: str,
    rank: int,
    alpha: float,
    dropout: float,
    targets: str,
    base_dtype: str = "",
) -> Spec | None:
    """The adapters of flags --lora-rank, --lora-alpha (0: 2 x rank), --lora-dropout,
    --lora-targets (comma list; empty: the family's default) and --lora-base-dtype for a
    family whose targets are `table`; None at rank 0. UsageError (one line) for a value that
    is not valid."""
    if base_dtype not in nf4.BASE_DTYPES:
        raise UsageError(
            f"--lora-base-dtype {base_dtype!r} is not a base storage; valid: nf4 (4-bit "
            f"NormalFloat), int8 (blockwise absmax int8), or empty for the working dtype"
        )
    if rank < 0:
        raise UsageError(f"--lora-rank {rank} must be 0 (no LoRA) or a positive rank")
    # checked at rank 0 too: a saved config keeps them, and a resume or --lora-rank later
    # would take them up
    if not 0 <= alpha < math.inf:  # 0: the default, 2 x rank; NaN fails both comparisons
        raise UsageError(f"--lora-alpha {alpha} must be positive and finite (0: 2 x rank)")
    if not 0 <= dropout < 1:
        raise UsageError(f"--lora-dropout {dropout} must be in [0, 1)")
    if rank == 0:
        if targets:
            raise UsageError(f"--lora-targets {targets!r} needs --lora-rank > 0")
        if base_dtype:
            raise UsageError(
                f"--lora-base-dtype {base_dtype} stores a LoRA run's frozen base and needs "
                f"--lora-rank > 0; without LoRA every param is trained in the working dtype"
            )
        return None
    if not table:
        raise UsageError(f"model family {family!r} declares no LoRA targets")
    names = [n.strip() for n in targets.split(",") if n.strip()] if targets else list(default)
    unknown = [n for n in names if n not in table]
    if unknown or not names:
        raise UsageError(
            f"--lora-targets {targets!r}: {', '.join(unknown) or 'no name'} is not a target of "
            f"the {family} family; valid: {', '.join(table)}"
        )
    chosen = {n: table[n] for n in dict.fromkeys(names)}
    scale = float(alpha) if alpha > 0 else 2.0 * rank
    quantized = dict(table) if base_dtype else {}
    return Spec(rank, scale, chosen, float(dropout), base_dtype, quantized)


# The name of a target's adapters on a model's second stack of layers (its dense-MLP layers,
# models/layer_groups.py): "q" adapts blocks/attn/wq, "q@dense" dense_blocks/attn/wq.
TWIN = "@dense"


def with_dense_twins(
    targets: dict[str, tuple[tuple[str, ...], ...]], state: Any
) -> dict[str, tuple[tuple[str, ...], ...]]:
    """`targets` and, on a model whose params hold a second stack (DENSE_STACK), each stacked
    target's twin on it (TWIN), where that stack has the target's weights: one A and B per
    stack, as each stack's layers are their own Linears."""
    out = dict(targets)
    if DENSE_STACK not in state:
        return out
    for name, paths in targets.items():
        twins = tuple((DENSE_STACK, *p[1:]) for p in paths if p[0] == STACKED)
        if twins and len(twins) == len(paths) and all(_has(state, p) for p in twins):
            out[name + TWIN] = twins
    return out


def stacked_path(path: tuple[str, ...]) -> tuple[str, ...]:
    """A param path with its stack named as the tensor tables name every stack's (STACKED)."""
    return (STACKED, *path[1:]) if path[0] in STACKS else path


def _has(tree: Any, path: tuple[str, ...]) -> bool:
    for key in path:
        if key not in tree:
            return False
        tree = tree[key]
    return True


def in_dims_of(tensors: tuple[Rule, ...], path: tuple[str, ...]) -> int:
    """How many leading dims (after `layers`) of the param at `path` are its input: the HF
    table's in_dims (1 where the table does not name it)."""
    return next((d for p, _, d in tensors if p == path and d > 0), 1)


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


class LoraModel(nnx.Module):
    """A base CausalLM under `frozen` and its adapters under `lora` (target -> "a" and "b"
    {param name: B}); the CausalLM pieces run the adapted model (`adapted`)."""

    def __init__(
        self, base: Any, spec: Spec, tensors: tuple[Rule, ...], rngs: nnx.Rngs, seed: int = 0
    ):
        self.frozen, self.cfg, self.dtype = base, base.cfg, base.dtype
        self.scale, self.rate, self.seed = spec.scale, spec.dropout, seed
        state = nnx.state(base)
        targets = with_dense_twins(spec.targets, state)
        self.targets = nnx.static(targets)
        self.in_dims = nnx.static(
            {p: in_dims_of(tensors, stacked_path(p)) for ps in targets.values() for p in ps}
        )
        adapters = {}
        for name, paths in targets.items():
            adapters[name] = self._adapter(state, paths, spec.rank, rngs)
        self.lora = nnx.data(adapters)
        # QLoRA: the base's projections as NF4 (or int8) codes, after the adapters took their shapes
        stored = [p for ps in with_dense_twins(spec.quantized, state).values() for p in ps]
        if stored:
            stored += EMBEDDINGS
        self.quantized = nnx.static(tuple(p for p in stored if _has(state, p)))
        if self.quantized:
            nf4.quantize_base(base, list(self.quantized), base.dtype, spec.base_dtype)

    def _adapter(self, state: Any, paths: tuple, rank: int, rngs: nnx.Rngs) -> dict:
        first = _get(state, paths[0])
        names = first.get_metadata().get("out_sharding") or (None,) * first.ndim
        lead = 1 if paths[0][0] in STACKS else 0
        ins = lead + self.in_dims[paths[0]]
        fan_in = math.prod(first.shape[lead:ins])
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) on a [r, fan_in] Linear
        a_shape = (*first.shape[:ins], rank)
        a = jax.random.uniform(rngs.params(), a_shape, jnp.float32, -bound, bound)
        b = {}
        for path in paths:
            w = _get(state, path)
            w_names = w.get_metadata().get("out_sharding") or (None,) * w.ndim
            out_shape = (*w.shape[:lead], rank, *w.shape[ins:])
            b[path[-1]] = nnx.Param(
                jnp.zeros(out_shape, jnp.float32),
                out_sharding=(*w_names[:lead], None, *w_names[ins:]),
            )
        return {"a": nnx.Param(a, out_sharding=(*names[:ins], None)), "b": b}

    def adapted(self) -> Any:
        """The base model (a copy of its graph, the same arrays) with each target's adapter
        beside its projection: a models.adapter.Site at `<weight>_lora`, the target's number
        naming its dropout mask (a fused target's paths share it, as peft's one Linear)."""
        graphdef, state = nnx.split(self.frozen)
        model = nnx.merge(graphdef, state)
        for number, (name, paths) in enumerate(self.targets.items()):
            a = self.lora[name]["a"]
            stacked = paths[0][0] in STACKS
            layers = None
            if self.rate and stacked:  # each layer's global index, for its own dropout masks
                index = self._layer_numbers(paths[0][0], a[...].shape[0]) + first_layer()
                layers = nnx.Variable(index.astype(jnp.float32))
            for path in paths:
                module = model
                for key in path[:-1]:
                    module = getattr(module, key)
                b = self.lora[name]["b"][path[-1]]
                site = adapter.Site(a, b, layers, self.scale, self.rate, number, self.in_dims[path])
                setattr(module, path[-1] + adapter.SUFFIX, site)
        return model

    def _layer_numbers(self, stack: str, rows: int) -> jax.Array:
        """The model's index of each of a stack's `rows` layers (its rows in order where the
        model has one stack; models/layer_groups.py where it has two)."""
        dense = layer_groups.dense_of(self.cfg)
        if not dense:
            return jnp.arange(rows)
        return jnp.asarray(layer_groups.stack_layers(dense, self.cfg.n_layers, stack != STACKED))

    def merged(self) -> Any:
        """The base model with every target's weight W + scale * A @ B (in W's dtype); a QLoRA
        base's merged into its dequantized weights (models/nf4.py), in the compute dtype."""
        base = nf4.dequantized(self.frozen, list(self.quantized)) if self.quantized else self.frozen
        graphdef, state = nnx.split(base)
        pure = nnx.to_pure_dict(state)
        for name, paths in self.targets.items():
            adapter = self.lora[name]
            for path in paths:
                parent = _get(pure, path[:-1])
                lead = 1 if path[0] in STACKS else 0
                b = adapter["b"][path[-1]][...]
                w = parent[path[-1]]
                parent[path[-1]] = merge_weight(w, adapter["a"][...], b, self.scale, lead)
        nnx.replace_by_pure_dict(state, pure)
        return nnx.merge(graphdef, state)

    def __call__(self, tokens: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        return self.adapted()(tokens, segments)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return self.frozen.embed_tokens(tokens)  # no target is the embedding

    def apply_blocks(self, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        model, inputs = self.adapted(), chunk_inputs()
        if inputs is None or not (self.rate and training()):
            return model.apply_blocks(x, segments)
        # a pipeline chunk (the loss, which opens the masks, runs outside the schedule)
        with adapter.noise(adapter.token_keys(inputs, self.seed, training_step())):
            return model.apply_blocks(x, segments)

    def head_logits(self, x: jax.Array) -> jax.Array:
        return self.frozen.head_logits(x)  # no target is the head


def merge_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float, lead: int) -> jax.Array:
    """W + scale * A @ B in W's dtype, for W [L?, *in, *out], A [L?, *in, r] and
    B [L?, r, *out] (`lead`: 1 where they carry the stacked `layers` dim, else 0)."""
    r = a.shape[-1]
    a2 = a.reshape(*a.shape[:lead], -1, r)
    b2 = b.reshape(*b.shape[: lead + 1], -1)
    delta = jnp.matmul(a2.astype(w.dtype), b2.astype(w.dtype))
    return w + (scale * delta).reshape(w.shape).astype(w.dtype)


def adapted_loss(loss: Callable[[Any, dict], jax.Array]) -> Callable[[Any, dict], jax.Array]:
    """A family's `loss(model, batch)` of a LoraModel: the loss of its adapted model, with
    dropout on the adapters' input in a train step (models/adapter.py), keyed by the batch's
    tokens and the model's seed."""

    def lora_loss(model: Any, batch: dict) -> jax.Array:
        if not (model.rate and training()):
            return loss(model.adapted(), batch)
        keys = adapter.token_keys(batch["inputs"], model.seed, training_step())
        with adapter.noise(keys):
            return loss(model.adapted(), batch)

    return lora_loss


def adapted_metrics(metrics: Callable[[Any, dict], dict]) -> Callable[[Any, dict], dict]:
    """A family's `step_metrics(model, batch)` of a LoraModel: the figures of its adapted model
    (no dropout: a log record reads the model as it is, as an eval does). The family's
    functions use more of its own model than the CausalLM pieces a LoraModel forwards (an
    MoE's `forward` with the router's statistics), so they run on the adapted model, never on
    the LoraModel itself."""

    def lora_metrics(model: Any, batch: dict) -> dict:
        return metrics(model.adapted(), batch)

    return lora_metrics


def with_reference(
    fn: Callable[[Any, dict], Any], reference: Callable[[Any, dict], jax.Array], key: str
) -> Callable[[Any, dict], Any]:
    """`fn(model, batch)` of a LoraModel with batch[`key`] = reference(the frozen base, batch):
    a preference objective's reference figures (spmd.engine.preference) from the base with
    its adapters off, the same arrays as the policy's base, so no second copy of the weights
    exists. Under stop_gradient: the reference is a constant of the loss."""

    def run(model: Any, batch: dict) -> Any:
        ref = jax.lax.stop_gradient(reference(model.frozen, batch))
        return fn(model, {**batch, key: ref})

    return run


def wrap(base: Any, spec: Spec, tensors: tuple[Rule, ...], seed: int) -> LoraModel:
    """`base` with fresh adapters of `spec` (A from `seed`'s stream, B zeros)."""
    with nnx.use_eager_sharding(False):
        return LoraModel(base, spec, tensors, nnx.Rngs(seed + 1), seed)
