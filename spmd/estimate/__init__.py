"""What a layout will cost before or without running it, and what a compiled step really costs.

The planner behind `python -m spmd.plan`, pure arithmetic: `shape` (a model's params and a
Llama shape for a bare count), `cost` (the layout, its collectives and their ring times),
`memory` (bytes per device by role, the ZeRO paper's formulas), `timing` (compute, bubble and
exposed communication of a step), `search` (every knob, fastest that fits), `recommend` (why,
runner-ups, the train command), `summary` (the report) and `plot` (the picture). Against real
programs: `theory` gives the textbook collective volumes of a concrete run; `hlo` reads
collectives (count, bytes) and per-device memory from a compiled step (`hlo_text` parses its
text); `flops` counts model FLOPs (formula and compiled dots); `measure` compiles the real
step on simulated devices to compare with the analytic model.
"""
