"""What one training step is: the Program of a model, loss, optimizer and layout.

`step` builds the Program (sharded init, jitted train and eval steps) of a model, loss,
optimizer and layout under either executor (`auto` holds the auto executor's steps;
spmd.engine.explicit the explicit one's), from `abstract` (the model traced without
allocating: its graph, logical names and shapes) and `state_layout` (where params, gradients
and optimizer state live, and the bytes a device holds of them); `accumulate` loops over
micro-batches inside a step; `precision` holds the dtype policies (fp32 / bf16 / fp16 with dynamic
loss scaling); `optim` says what an optimizer is (AdamW the default) and holds what every one shares
(clipping, warm-up + cosine, LR scaling), `optimizers` is the --optimizer registry that makes
the run's optax chain, `objectives` the --objective registry (`objective`: what an objective
is, next-token prediction the default);
`explicit` is the hand-written executor (shard_map with psum / all_gather / psum_scatter)
beside `auto`; `diloco` runs replicas with local steps and an outer optimizer. The loop that
runs a Program is spmd.training's.
"""
