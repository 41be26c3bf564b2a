"""Everything that crosses the disk: training data in, checkpoints and weights out and back.

`tokens` tokenizes text once into a memory-mapped cache; `data` turns it into step-indexed,
process-sharded global batches (a function of seed and step only); `checkpoint` is orbax
(async, sharded, restored onto any mesh); `params_io` reads params-only
checkpoints; `safetensors_io` reads and writes the safetensors format.
"""
