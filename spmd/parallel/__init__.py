"""How work is split across devices: the mesh and the strategies that live on it.

`layout` is a run's mesh + ZeRO stage + sequence parallelism; `mesh` parses `--mesh
dp=2,fsdp=2,tp=2` and builds the device mesh (ICI x DCN across hosts, simulated CPU devices on a
laptop); `distributed` joins a multi-process job; `rules` maps the model's logical axis names onto
mesh axes per role and ZeRO stage (DDP, ZeRO-1/2/3, Megatron and pipeline layouts are entries of
that table); `hooks` is the only module a model imports (gather, tp_enter, tp_reduce, constrain,
scan_layers, ...), made real by the layout the engine traces a step under (`traced_layout`);
`layer_scan` runs a model's stacked layers under the remat policy, with ZeRO-3's next-layer gather
prefetched in the explicit executor; `collectives` are the hand-written executor's building blocks
(psum / all_gather / psum_scatter), `buckets` its gradient buckets; `schedules`, `pipeline` and
`pipeline_stage` run pipeline schedules (GPipe, 1F1B, interleaved) over the `pipeline` axis;
`ring_attention` is context parallelism's causal ring over `context`; `xla_flags` sets the GPU
preset before JAX starts, `huge_pages` the CPU preset's malloc tunable. New strategies land
here, each as its own module plus rule entries.
"""
