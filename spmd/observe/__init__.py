"""What a run tells the people watching it.

`metrics` writes the JSONL records and the console lines; `observer` adds TFLOP/s, MFU,
device memory and stragglers to each logged step; `profile` traces steps and breaks them into
compute, each collective kind and idle time; `tensorboard` mirrors the records as scalars;
`stragglers` names processes slower than the rest. (`python -m spmd.report` draws them.)
"""
