"""The middle floor: what the commands share between the command line and the core packages.

Flags, TOML files, Hub ids and Hugging Face or peft folders become a run's resolved config
(parser, config, section_views, plan_flags, and resolve, where spmd.train, spmd.bench and
spmd.plan get theirs), the config becomes a Program (builder, with the run-level checks;
run_setup describes it), and a model's weights are read for the commands (weights, with
generate's decoding loop). The commands (spmd.train, spmd.plan, ...) import it; no core package
(spmd.engine, spmd.parallel, spmd.estimate, spmd.io, spmd.observe, spmd.training) does. Importing
this package loads nothing: `spmd.cli` and shell completion stay free of jax.
"""
