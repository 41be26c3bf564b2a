"""What one training run executes: the program and the loop around it.

`step` builds the Program (sharded init, jitted train and eval steps) of a model, loss,
optimizer and layout under either executor (`auto` holds the auto executor's steps;
spmd.parallel.explicit the explicit one's), from `abstract` (the model traced without
allocating: its graph, logical names and shapes) and `state_layout` (where params, gradients
and optimizer state live, and the bytes a device holds of them); `accumulate` loops over
micro-batches inside a step; `precision` holds the dtype policies (fp32 / bf16 / fp16 with dynamic
loss scaling); `optim` is the optax chain (AdamW, clipping, warm-up + cosine, LR scaling);
`loop` runs the optimizer steps with progress, eval and checkpoints; `divergence` checks every
step's loss and gradient norm and stops, rolls back or goes on when they diverge; `diloco` runs
replicas with local steps and an outer optimizer.
"""
