"""What a layout will cost before or without running it, and what a compiled step really costs.

`cost` is the analytic memory and communication model behind `python -m spmd.plan`;
`recommend` searches layouts with it; `theory` gives the textbook collective volumes of a
concrete run; `hlo` reads collectives (count, bytes) and per-device memory from a compiled
step; `flops` counts model FLOPs (formula and compiled dots); `measure` compiles the real step
on simulated devices to compare with the analytic model.
"""
