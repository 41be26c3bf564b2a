"""3-D: data parallel x fully sharded x tensor parallel in one mesh (dp=2, fsdp=2, tp=rest).

Collectives per step: Megatron's activation all-reduces over `tensor` ((4L + 2) * k of A
bytes), ZeRO-3's all-gathers (2k * P_L + (P - P_L), of the 1/tp param shards) and
reduce-scatter (k * P/(F*T)) over `fsdp`, and one all-reduce of the 1/(fsdp*tp) gradient
shards over `data`, once per step. Explicit: exactly these. Auto on XLA:CPU: about 1.9x the
all-reduce bytes for tiny, with the fsdp and data gradient reductions as all-reduces inside the
backward layer loop.
"""

from meshes.preset import Preset

PRESET = Preset(
    name="3d",
    mesh="dp=2,fsdp=2,tp=-1",
    zero=3,
    summary="data x fsdp x tensor",
    collectives="TP all-reduces over tensor, ZeRO-3 over fsdp, grad all-reduce over data",
)
