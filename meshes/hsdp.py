"""HSDP: ZeRO-3 within groups of `fsdp` devices (F), plain replication across `data` groups (D).

Collectives per step: ZeRO-3's all-gathers (2k * P_L + (P - P_L) bytes of results) and
reduce-scatter (k * P/F) over `fsdp`, inside each group (the fast links), then one all-reduce
of the 1/F gradient shards over `data`, P/F bytes (ring 2(D-1)/D * P/F), once per step whatever
k. Explicit: exactly these. Auto on XLA:CPU: the fsdp gradient reduction shows as all-reduces
of P bytes, about 5x the explicit all-reduce bytes for the tiny model. Two data groups by
default; the rest of the devices form the fsdp axis.
"""

from meshes.preset import Preset

PRESET = Preset(
    name="hsdp",
    mesh="dp=2,fsdp=-1",
    zero=3,
    summary="sharded within a group, replicated across groups",
    collectives="ZeRO-3 within fsdp, all-reduce of grad shards over data P/F",
)
